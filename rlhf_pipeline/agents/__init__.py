"""Multi-turn, tool-using agents: environments, tools and token-exact episodes.

* :mod:`.environment` -- the ``Environment`` protocol a pipeline file implements, ``ModelTurn``,
  ``StepResult`` and ``EnvironmentRunner`` (sync steps in a thread pool, async ones awaited, a
  per-step timeout);
* :mod:`.tools` -- tools as typed Python functions, their JSON schemas, tool-call parsers per
  chat-template family, and ``ToolBox``, which runs calls and turns every failure into an answer;
* :mod:`.episode` -- ``Episode``: the token list as the source of truth (sampled ids verbatim,
  environment messages tokenized as the template renders them), the loss mask, the limits, the
  rows it stores (one per turn) and ``rebuild_trajectory`` from those rows;
* :mod:`.rollout` -- many episodes stepped concurrently with generation batched over them; an
  episode that fails drops its group, with the reason;
* :mod:`.workers` -- the threads tool calls and sync steps run on, where a hung call frees its slot;
* :mod:`.calculator` -- a toy environment (products, with a ``multiply`` tool), a warm start on
  demonstration episodes and a greedy check of what it reached;
* :mod:`.verifiers_env` -- a ``verifiers`` environment (``MultiTurnEnv``, ``ToolEnv``, its rubric)
  as an ``Environment`` (the optional ``verifiers`` extra).

``docs/agents.md`` says what is built, what a turn costs on disk and what is not built yet.

This package knows rows (``schema``) and models; storage, the write path and the learner are the
caller's business: ``collect/agent_collector.py`` runs rollouts with the policy and writes them.
"""
