"""Multi-turn, tool-using agents: environments, tools and token-exact episodes. :mod:`.environment` (the
``Environment`` protocol and its runner), :mod:`.tools` (typed tools, call parsers, ``ToolBox``),
:mod:`.episode` (the token list and the rows it stores), :mod:`.rollout` (many episodes at once),
:mod:`.workers` (threads a hung call cannot starve), :mod:`.calculator` (a toy environment and its warm
start), :mod:`.templates` (the chat-template check), :mod:`.verifiers_v1` and :mod:`.verifiers_env`
(verifiers environments, the optional ``verifiers`` extra).

Knows rows and models, not storage: the collector (``collect/collector.py``, over
``collect/episodes.py``'s ``Environments``) writes what rollouts return.
User's guide: docs/agents.md; design: docs/architecture.md#episodes-are-token-lists.
"""
