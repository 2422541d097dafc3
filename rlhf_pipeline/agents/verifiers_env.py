"""verifiers 0.1.10 environments (``MultiTurnEnv``, ``ToolEnv``, their ``Rubric``) as our
:class:`~.environment.Environment`.

:class:`VerifiersEnvironment` drives the environment's side of verifiers' ``rollout`` one model turn
at a time, calling its methods in its order, while our rollout generates; a turn's reward is the
rubric score's change since the previous turn. Endings map to our reasons (``max_turns_reached`` ->
``MAX_TURNS``, ``prompt_too_long`` -> ``CONTEXT_FULL``, a ``vf.ToolError`` -> ``TOOL_ERROR``, any
other stop -> ``ENV_DONE``); what does not fit is refused by name (docs/agents.md). ``verifiers`` is
imported when an adapter is built. Design: docs/architecture.md#episodes-are-token-lists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlhf_pipeline.agents.environment import Message, ModelTurn, StepResult
from rlhf_pipeline.schema.termination import TerminationReason

REASONS = {
    "max_turns_reached": TerminationReason.MAX_TURNS,
    "prompt_too_long": TerminationReason.CONTEXT_FULL,
}
"""verifiers' stop conditions that are not ``ENV_DONE`` (``has_error`` is decided by its error)."""

TESTED_VERSIONS = ("0.1.10",)
"""The verifiers releases this adapter is tested on (tests/agents/test_verifiers_env.py). 0.1.11
changed what its hooks take and return (typed messages, its own model client) and 0.4 removed
the stack: tasksets for verifiers 0.4 run through :mod:`.verifiers_v1`."""

DEFAULT_SAMPLING_ARGS = {"n": 1, "extra_body": {}}
"""What a verifiers environment's ``sampling_args`` are when it was given none."""


def import_verifiers():
    """The ``verifiers`` module, or an error that says how to install it."""
    try:
        import verifiers
    except ImportError as exc:
        raise ImportError("the verifiers adapter needs the verifiers package: pip install -e '.[verifiers]' "
                          "(or pip install 'rlhf-pipeline[verifiers]')") from exc
    return verifiers


def import_classic_verifiers(env):
    """The ``verifiers`` module with its classic ``MultiTurnEnv`` stack, or an error that says which
    adapter runs ``env`` (a ``verifiers.v1`` Taskset) or this verifiers (0.4 has no classic stack)."""
    vf = import_verifiers()
    try:
        from verifiers import v1
    except ImportError:
        v1 = None
    if isinstance(env, getattr(v1, "Taskset", ())):
        raise TypeError(f"{type(env).__name__} is a verifiers.v1 Taskset: it runs through VerifiersV1Environment, "
                        "its tasks listed by verifiers_v1_tasks (rlhf_pipeline.agents.verifiers_v1)")
    if not hasattr(vf, "MultiTurnEnv"):
        raise TypeError(f"verifiers {vf.__version__} has no MultiTurnEnv (0.4 removed the classic stack this adapter "
                        "runs): its environments are verifiers.v1 Tasksets, run by VerifiersV1Environment "
                        "(rlhf_pipeline.agents.verifiers_v1)")
    if vf.__version__ not in TESTED_VERSIONS:
        raise ImportError(f"VerifiersEnvironment drives the rollout hooks of verifiers {' and '.join(TESTED_VERSIONS)}; "
                          f"verifiers {vf.__version__} changed them: pip install 'verifiers==0.1.10' for "
                          "MultiTurnEnv environments (tasksets for verifiers 0.4 run through VerifiersV1Environment)")
    return vf


def verifiers_tasks(env, n: int = -1, seed: int | None = None) -> list[dict[str, Any]]:
    """Rows of a verifiers environment's dataset (``env.get_dataset(n, seed)``), as tasks for
    ``rollout`` or ``TaskSource``: each with its formatted ``prompt``, ``answer``, ``info``,
    ``example_id`` and ``task``."""
    import_classic_verifiers(env)
    return [dict(row) for row in env.get_dataset(n, seed)]


def check_verifiers_env(env, *, ignore_sampling_args: bool = False) -> None:
    """Refuses a verifiers environment this adapter cannot run as verifiers would, saying why."""
    vf = import_classic_verifiers(env)
    name = type(env).__name__
    if not isinstance(env, vf.MultiTurnEnv):
        raise TypeError(f"{name} is not a verifiers MultiTurnEnv: only MultiTurnEnv subclasses (ToolEnv, "
                        "SingleTurnEnv, ...) are stepped turn by turn; an EnvGroup routes whole rollouts, "
                        "so wrap each of its environments instead")
    if env.message_type != "chat":
        raise ValueError(f"{name}.message_type is {env.message_type!r}: episodes are chat conversations "
                         "rendered by the chat template; build the environment with message_type='chat'")
    if not env.score_rollouts:
        raise ValueError(f"{name}.score_rollouts is False: its rewards would all be 0; "
                         "call env.set_score_rollouts(True)")
    extra = {k: v for k, v in env.sampling_args.items() if DEFAULT_SAMPLING_ARGS.get(k, object()) != v}
    if extra and not ignore_sampling_args:
        raise ValueError(f"{name}.sampling_args sets {extra}, which this adapter cannot honour: the sampler "
                         "passed to rollout (the collector's model and SamplingConfig) generates, not the "
                         "environment's client. Set them there, or pass ignore_sampling_args=True")
    reward_funcs, group_funcs = [], []
    for rubric in leaf_rubrics(env.rubric):
        for func, weight in zip(rubric.funcs, rubric.weights, strict=True):
            if rubric._is_group_func(func):  # verifiers' own test (parameters named states, completions, ...)
                group_funcs.append(getattr(func, "__name__", repr(func)))
            elif weight != 0:
                reward_funcs.append(func)
    if group_funcs:
        raise ValueError(f"{name}'s rubric has group reward functions {group_funcs}: they score a whole group "
                         "at once, and an episode's reward is given when it ends, without its group. "
                         "Write them per rollout (prompt, completion, answer, state), or use GroupAdvantage "
                         "for what is relative to the group")
    if not reward_funcs:
        raise ValueError(f"{name}'s rubric has no reward function with a nonzero weight (only metrics): "
                         "every reward would be 0; give the environment rubric=vf.Rubric(funcs=[...])")


def leaf_rubrics(rubric) -> list:
    """The rubrics a ``RubricGroup`` (``MultiTurnEnv`` adds its monitors as one) is made of."""
    nested = getattr(rubric, "rubrics", None)
    if nested is None:
        return [rubric]
    return [leaf for inner in nested for leaf in leaf_rubrics(inner)]


class VerifiersEnvironment:
    """One episode of a verifiers ``MultiTurnEnv`` (shared between episodes; its state is ours)."""

    def __init__(self, env, *, ignore_sampling_args: bool = False):
        check_verifiers_env(env, ignore_sampling_args=ignore_sampling_args)
        self.env = env
        self.state = None
        """The episode's verifiers ``State``: its trajectory, ``stop_condition``, ``reward``, ``metrics``."""
        self.score = 0.0
        """The rubric's score of the conversation after the last turn (the sum of the rewards so far)."""
        self._prompt: list[Message] = []  # the conversation before the model's next turn, as verifiers holds it

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools the chat template lists: the state's ``oai_tools`` (per row, or the environment's)."""
        if self.state is None:
            raise RuntimeError("tool_schemas are known after reset")
        return list(self.state.get("oai_tools") or []) or None

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        vf = import_verifiers()
        if self.state is not None:
            raise RuntimeError("a VerifiersEnvironment runs one episode; make_env must build a new one each time")
        state = await self.env.init_state(self._rollout_input(task), client=None, model="", sampling_args=None)
        self.state = state
        try:
            state = self.state = await self.env.setup_state(state)
        except vf.Error as exc:  # as rollout does: kept in the state, and has_error ends the rollout
            state["error"] = exc
        if await self.env.is_completed(state):
            raise RuntimeError(f"{type(self.env).__name__} ended the episode before the model's first turn "
                               f"(stop condition {state.get('stop_condition')}: {state.get('error')!r})")
        self._prompt = list(await self.env.get_prompt_messages(state))
        return [plain_message(m) for m in self._prompt]

    async def step(self, turn: ModelTurn) -> StepResult:
        vf = import_verifiers()
        state = self.state
        if state is None or state["is_completed"]:
            raise RuntimeError("step before reset, or after the episode ended")
        message = assistant_message(turn)
        await self.env.add_trajectory_step(state, vf.TrajectoryStep(
            prompt=self._prompt, completion=[message], response=None, tokens=None, reward=None, advantage=None,
            is_truncated=not turn.finished, trajectory_id=state["trajectory_id"], extras={}))
        while not await self.env.is_completed(state):  # rollout's loop, from after the model's response
            try:
                prompt = await self.env.get_prompt_messages(state)  # calls env_response
            except vf.OverlongPromptError:
                state["prompt_too_long"] = state["is_truncated"] = True
                continue
            except vf.Error as exc:
                state["error"] = exc
                continue
            if state.get("final_env_response") is not None:
                continue
            new = self._new_messages(list(prompt), message)
            self._prompt = list(prompt)
            return StepResult([plain_message(m) for m in new], reward=await self._turn_reward(),
                              info={"verifiers_score": self.score})
        reason = self._reason()
        reward = await self._turn_reward()
        return StepResult(done=True, reason=reason, reward=reward,
                          info={"verifiers_score": self.score, "stop_condition": state.get("stop_condition"),
                                "metrics": dict(state.get("metrics") or {})})

    # ------------------------------------------------------------------ helpers
    def _rollout_input(self, task: Mapping[str, Any]) -> dict[str, Any]:
        if task.get("prompt") is not None:
            prompt = task["prompt"]
            if not isinstance(prompt, list):
                raise ValueError(f"task['prompt'] must be a list of chat messages, got {type(prompt).__name__}")
        elif task.get("question") is not None:  # a raw row: build the prompt as verifiers formats its dataset
            prompt = ([{"role": "system", "content": self.env.system_prompt}] if self.env.system_prompt else []) \
                + list(self.env.few_shot or []) + [{"role": "user", "content": task["question"]}]
        else:
            raise ValueError(f"a task needs 'prompt' (chat messages) or 'question'; got the fields {sorted(task)}. "
                             "Pass rows of env.get_dataset() (verifiers_tasks(env))")
        row = {"prompt": prompt, "example_id": int(task.get("example_id") or 0),
               "task": task.get("task") or self.env.env_id or "default"}
        for key in ("answer", "info"):
            if task.get(key) is not None:
                row[key] = task[key]
        return row

    def _new_messages(self, prompt: list[Message], message: Message) -> list[Message]:
        before = [*self._prompt, message]
        if prompt[:len(before)] != before:
            raise ValueError(f"{type(self.env).__name__}.get_prompt_messages returned a conversation that does not "
                             "extend the previous turn's (its messages before the model's last turn changed): an "
                             "episode is one token list that only grows, so non-linear conversations cannot be stepped")
        return prompt[len(before):]

    async def _turn_reward(self) -> float:
        """The change of the rubric's score since the last turn, plus a reward the environment set
        on this turn's trajectory step."""
        await self.env.render_completion(self.state)
        await self.env.rubric.score_rollout(self.state)
        score = float(self.state["reward"])
        reward, self.score = score - self.score, score
        own = self.state["trajectory"][-1].get("reward")
        return reward + (float(own) if own is not None else 0.0)

    def _reason(self) -> TerminationReason:
        vf = import_verifiers()
        condition = self.state.get("stop_condition")
        if condition == "has_error":
            error = self.state["error"]
            if isinstance(error, vf.ToolError):
                return TerminationReason.TOOL_ERROR
            raise RuntimeError(f"{type(self.env).__name__} failed: {error!r} (a verifiers error that is not the "
                               "model's tool call: the environment's own failure is not data)") from error
        return REASONS.get(condition, TerminationReason.ENV_DONE)


def assistant_message(turn: ModelTurn) -> Message:
    """The model's turn as verifiers reads an assistant message: ``content`` is the text as sampled,
    ``tool_calls`` (only when there are some) in OpenAI's format, arguments a JSON string. A call
    our parser could not read keeps its raw text as its arguments, so verifiers' ``env_response``
    answers it with its own parse error (``error_formatter``) rather than running it."""
    message: Message = {"role": "assistant", "content": turn.text}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{turn.index}_{k}",  # the key order of openai's model_dump, as verifiers stores it
             "function": {"arguments": json.dumps(dict(call.arguments)) if call.error is None
                          else unparseable(call.raw, call.error), "name": call.name},
             "type": "function"}
            for k, call in enumerate(turn.tool_calls)]
    return message


def unparseable(raw: str, error: str) -> str:
    """A malformed call's text as arguments verifiers' ``json.loads`` refuses, so the call is
    answered with its parse error and never run (a raw call can be valid JSON, e.g. one with no
    ``name``: our parser's reason is then appended, which no JSON parser reads past)."""
    try:
        json.loads(raw)
    except ValueError:
        return raw
    return f"{raw} <- {error}"


def plain_message(message: Mapping[str, Any]) -> Message:
    """A verifiers message as a plain dict without the ``None`` fields a Hugging Face dataset adds
    to every message of a column (chat templates test ``is defined``, which ``None`` passes)."""
    return {k: v for k, v in dict(message).items() if v is not None}
