"""One evaluation: a policy version on a held-out set, every completion a row of the set's eval store.

Each set has its own store, ``<run>/eval/<set>``, never the training buffer. A row is one completion
(an agent's episode: one row per model turn): ``reward`` is its score, ``policy_version`` the version
evaluated, and its ids come from (version, prompt, sample) (``ID_STRIDE``): unique in the store, and the
same in every evaluation of that sample. The evaluator's progress is the store's writer state, published
with each chunk of rows in one append, so a killed process resumes with no (version, prompt, sample)
written twice or skipped; a failing scorer or engine is recorded as failed for that version, which is
tried again from the prompt it failed at. Design: docs/evaluation.md#results-the-eval-store-and-the-metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_pipeline.evaluation.sampling import eval_sampling, eval_seed, sample_eval
from rlhf_pipeline.evaluation.scores import summarize
from rlhf_pipeline.evaluation.sets import EvalSet
from rlhf_pipeline.evaluation.settings import EvalSettings
from rlhf_pipeline.generation.engine import EngineStopped

EVAL_DIR = "eval"
"""Under a run directory: one store per set, and the evaluator's metrics (``metrics.jsonl``)."""
ID_STRIDE = 1_000_000
"""Group ids of one version's prompts start at ``version * ID_STRIDE``: a set holds fewer prompts."""
CHUNK_PROMPTS = 8
"""Prompts (tasks) per append: what a kill costs again at most."""
MAX_ATTEMPTS = 3
"""Tries of one (version, set) before the evaluator gives it up (it stays recorded as failed)."""


def eval_root(run_root: str | Path) -> Path:
    return Path(run_root) / EVAL_DIR


def set_store_location(run: str | Path, name: str) -> str | Path:
    """Where the rows of the evaluation ``name`` live (:func:`evaluation_name`): under the run's
    directory, or its URL (a run at a URL keeps them beside its buffer, in the object store)."""
    if "://" in str(run):
        return f"{str(run).rstrip('/')}/{EVAL_DIR}/{name}"
    return eval_root(run) / name


def evaluation_name(eval_set: EvalSet, settings: EvalSettings) -> str:
    """The set's name, plus how it is sampled unless greedily on every prompt (``held_out-k4-t1``):
    the name of its store and of its metrics."""
    return eval_set.name + settings.suffix(len(eval_set.items(None)))


def eval_metrics_path(run_root: str | Path) -> Path:
    """The evaluator's metrics: one line per (version, set) evaluated, keyed by the learner step."""
    from rlhf_pipeline.coordination.eval_pins import EVAL_METRICS

    return Path(run_root) / EVAL_METRICS


@dataclass
class EvalProgress:
    """A set store's writer state: what is evaluated, and how far the version in progress got."""

    done: dict[int, dict[str, float]] = field(default_factory=dict)
    """Version -> its summary metrics."""
    logged: list[int] = field(default_factory=list)
    """Done versions whose summary line is in the metrics file."""
    current: int | None = None
    """The version being evaluated; its first ``len(scores)`` prompts are stored."""
    scores: list[list[float]] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)
    """Agents: turns, tool calls and failed calls of the current version's episodes so far."""
    failed: dict[int, str] = field(default_factory=dict)
    """Version -> the error of its last failed try (removed once it is done)."""
    attempts: dict[int, int] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        from rlhf_pipeline.storage.writer_state import encode

        return encode({"eval_progress": {k: getattr(self, k) for k in self.__dataclass_fields__}}, [])

    @classmethod
    def of(cls, store: Any) -> EvalProgress:
        from rlhf_pipeline.storage.writer_state import decode

        published = decode(store.writer_state, str(store.location))
        if published is None:
            return cls()
        return cls(**published["writer"]["eval_progress"])

    def gave_up(self, version: int) -> bool:
        return version not in self.done and self.attempts.get(version, 0) >= MAX_ATTEMPTS


def open_set_store(run: str | Path, eval_set: EvalSet, settings: EvalSettings, **options: Any) -> Any:
    """The store of ``eval_set`` sampled as ``settings`` say, opened for appending (made at its first
    evaluation). ``run``: the run's directory (a memmap store, as a buffer shard) or its URL (a Zarr
    store there, as the buffer at a URL; ``options``: its writer lock's ``lock_lease_s`` and
    ``lock_wait_s``, so an evaluator killed on another machine is waited out)."""
    from rlhf_pipeline.schema import StoreSchema
    from rlhf_pipeline.storage import NotAStoreError, create_store, open_store

    location = set_store_location(run, evaluation_name(eval_set, settings))
    try:
        return open_store(location, mode="a", **options)
    except NotAStoreError:  # nothing there yet (a store damaged outside this library is another error)
        pass
    at_url = isinstance(location, str)
    if not at_url:
        location.parent.mkdir(parents=True, exist_ok=True)
    optional = ("termination_reason", "tool_calls", "tool_errors", "tool_error_kinds", "turn_messages") \
        if eval_set.agents else ()
    return create_store(location, "zarr" if at_url else "memmap", schema=StoreSchema(optional=optional), **options)


class EvalEngineUnavailable(RuntimeError):
    """The evaluator could not obtain its engine (a server that does not answer or cannot serve the run,
    no vLLM environment); the message names the engine and why."""


class EvalFailed(RuntimeError):
    """One (version, set) evaluation failed (its scorer raised, its engine failed); recorded and retried."""


@dataclass
class Evaluation:
    """Evaluates versions of a policy on sets, with ``engine_for(version)`` -> an engine holding it."""

    tokenizer: Any
    settings: EvalSettings
    run_seed: int
    log: Callable[[int, Mapping[str, float]], None] = lambda step, metrics: None
    """``log(learner step, metrics)``: where the summary line of each (version, set) goes."""
    step_of: Callable[[int], int] = lambda version: version
    """The learner step that published a version."""

    def evaluate(self, engine: EvalEngine | None, eval_set: EvalSet, version: int, store: Any) -> dict[str, float] | None:
        """Evaluates ``version`` on ``eval_set`` into ``store`` (what is stored already is not done
        again) and logs its summary; returns the summary, or None when it failed (recorded in the
        store's progress) or was given up."""
        progress = EvalProgress.of(store)
        self._log_unlogged(progress, store)
        if version in progress.done:
            return progress.done[version]
        if progress.gave_up(version):
            return None
        try:
            self._evaluate(engine, eval_set, version, store, progress)
        except EngineStopped:  # a stop, not a failed try: the next start evaluates the version
            raise
        except Exception as exc:  # the scorer's, the environment's or the engine's: training goes on
            progress = EvalProgress.of(store)  # what the last publish says, not what the failed chunk began
            progress.failed[version] = f"{type(exc).__name__}: {exc}"
            progress.attempts[version] = progress.attempts.get(version, 0) + 1
            store.append(None, writer_state=progress.to_bytes())
            tries = progress.attempts[version]
            then = "given up" if tries >= MAX_ATTEMPTS else "tried again"
            print(f"[eval] version {version} on {evaluation_name(eval_set, self.settings)!r} failed (try {tries} of {MAX_ATTEMPTS}, "
                  f"{then}): {progress.failed[version]}", flush=True)
            return None
        progress = EvalProgress.of(store)
        self._log_unlogged(progress, store)
        return progress.done[version]

    def _log_unlogged(self, progress: EvalProgress, store: Any) -> None:
        """Done versions whose line a kill kept out of the metrics file: logged now (a kill between the
        line and this publish logs it twice, never not at all)."""
        unlogged = [v for v in sorted(progress.done) if v not in progress.logged]
        if not unlogged:
            return
        for version in unlogged:
            self.log(self.step_of(version), {**progress.done[version], "eval/policy_version": float(version)})
        progress.logged = sorted({*progress.logged, *unlogged})
        store.append(None, writer_state=progress.to_bytes())

    def _evaluate(self, engine: EvalEngine, eval_set: EvalSet, version: int, store: Any, progress: EvalProgress) -> None:
        if progress.current != version:  # a version left unfinished by a failure waits for its retry
            progress.current, progress.scores, progress.counts = version, [], {}
        items = eval_set.items(self.settings.max_prompts)
        if len(items) >= ID_STRIDE:
            raise EvalFailed(f"eval set {eval_set.name!r} has {len(items)} prompts; at most {ID_STRIDE - 1} are "
                             f"evaluated (its rows' group ids count them): set eval.max_prompts")
        chunk = self._agent_chunk if eval_set.agents else self._single_chunk
        while version not in progress.done:
            first = len(progress.scores)
            part = items[first:first + CHUNK_PROMPTS]
            rows, scores, counts = chunk(engine, eval_set, version, first, part)
            progress.scores += scores
            for name, value in counts.items():
                progress.counts[name] = progress.counts.get(name, 0.0) + value
            if len(progress.scores) == len(items):
                progress.done[version] = summarize(evaluation_name(eval_set, self.settings), progress.scores, eval_set.pass_score,
                                                   progress.counts if eval_set.agents else None)
                progress.failed.pop(version, None)
                progress.current, progress.scores, progress.counts = None, [], {}
            store.append(rows, writer_state=progress.to_bytes())  # the rows and how far they go, together

    # ------------------------------------------------------------------ single-turn
    def _single_chunk(self, engine: EvalEngine, eval_set: EvalSet, version: int, first: int,
                      prompts: Sequence[Any]) -> tuple[Any, list[list[float]], dict[str, float]]:
        from rlhf_pipeline.generation.engine import SampleRequest
        from rlhf_pipeline.schema import TrajectoryBatch

        k = self.settings.samples
        sampling = eval_sampling(self.settings.temperature, eval_set.max_new_tokens)
        rendered = [p.render(self.tokenizer) for p in prompts]
        pairs = [(i, j) for i in range(len(prompts)) for j in range(k)]
        requests = [SampleRequest(rendered[i], n=1) for i, _ in pairs]
        seeds = [eval_seed(self.run_seed, eval_set.name, version, first + i, j) for i, j in pairs]
        completions = sample_eval(engine.sampler, requests, seeds, sampling)
        log_probs = self._log_probs(engine, [r.prompt_ids for r in requests], completions)
        group = version * ID_STRIDE + first  # the group id of the chunk's first prompt
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        prompt_texts = [prompts[i].display_text(self.tokenizer) for i, _ in pairs]
        fields = {name: [prompts[i].fields[name] for i, _ in pairs] for name in prompts[0].fields}
        flat = _checked_scores(eval_set, eval_set.score(prompt_texts, texts, **fields), len(pairs))
        rows = TrajectoryBatch.from_rows([{
            "prompt_tokens": rendered[i], "response_tokens": c.token_ids, "response_log_probs": log_probs[n],
            "group_id": group + i, "trajectory_id": (group + i) * k + j, "step": 0, "reward": score,
            "done": True, "terminated": c.terminated, "truncated": not c.terminated, "policy_version": version,
            "prompt_text": prompt_texts[n], "response_text": texts[n],
        } for n, ((i, j), c, score) in enumerate(zip(pairs, completions, flat))])
        return rows, [flat[i * k:(i + 1) * k] for i in range(len(prompts))], {}

    # ------------------------------------------------------------------ agents
    def _agent_chunk(self, engine: EvalEngine, eval_set: EvalSet, version: int, first: int,
                     tasks: Sequence[Mapping[str, Any]]) -> tuple[Any, list[list[float]], dict[str, float]]:
        from rlhf_pipeline.agents.episode import AGENT_ROW_FIELDS
        from rlhf_pipeline.agents.rollout import RolloutConfig, run_episodes
        from rlhf_pipeline.generation.engine import SampleRequest

        k = self.settings.samples
        sampling = eval_sampling(self.settings.temperature, eval_set.limits.max_new_tokens)
        turns_taken: dict[int, int] = {}

        async def sample_turn(episode: int, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
            task, sample = divmod(episode, k)
            turn = turns_taken[episode] = turns_taken.get(episode, -1) + 1
            seed = eval_seed(self.run_seed, eval_set.name, version, first + task, sample, turn)
            (c,) = sample_eval(engine.sampler, [SampleRequest(ids, n=1, max_new_tokens=max_new_tokens)], [seed],
                               sampling)
            return c.token_ids, self._log_probs(engine, [ids], [c])[0]

        with engine.sampler.holding():  # one weights lease for the chunk's turns on a shared server
            rollout = asyncio.run(run_episodes(
                tasks, eval_set.make_env, sample_turn, self.tokenizer,
                RolloutConfig(group_size=k, limits=eval_set.limits), parser=eval_set.parser,
                stop_token_ids=engine.sampler.stop_token_ids))
        if rollout.failures:
            failure = rollout.failures[0]
            raise EvalFailed(f"task {first + failure.group}: {failure.reason}: {failure.message}")
        episodes = rollout.episodes
        if eval_set.score is None:
            flat = [float(sum(e.rewards)) for e in episodes]
        else:
            fields = {name: [tasks[n // k][name] for n in range(len(episodes))] for name in tasks[0]}
            finals = [e.turns[-1].text if e.turns else "" for e in episodes]
            flat = _checked_scores(eval_set, eval_set.score([""] * len(episodes), finals, **fields), len(episodes))
        group = version * ID_STRIDE + first
        rows = rollout.to_batch(first_group_id=group, first_trajectory_id=group * k, policy_version=version,
                                fields=AGENT_ROW_FIELDS)
        counts = {"turns": float(len(rows)), "tool_calls": float(rows["tool_calls"].sum()),
                  "failed_calls": float(rows["tool_errors"].sum())}
        return rows, [flat[i * k:(i + 1) * k] for i in range(len(tasks))], counts

    def _log_probs(self, engine: EvalEngine, prompts: Sequence[Sequence[int]],
                   completions: Sequence[Any]) -> list[list[float]]:
        """What a row stores as its log-probs: those it was sampled with, or, greedy, the policy's own
        (temperature 1, nothing cut): greedy sampling keeps one token, whose log-prob is 0 every time."""
        if self.settings.temperature > 0:
            return [c.log_probs for c in completions]
        return engine.scorer.score(prompts, [c.token_ids for c in completions])


def _checked_scores(eval_set: EvalSet, returned: Any, n: int) -> list[float]:
    """The scorer's values as floats, or EvalFailed naming the set and what is wrong."""
    import math

    from rlhf_pipeline.agents.environment import reward_value

    values = list(returned)
    if len(values) != n:
        raise EvalFailed(f"the scorer of eval set {eval_set.name!r} returned {len(values)} scores for {n} "
                         f"completions; return one per completion")
    scores = [reward_value(v, f"the score of completion {i} of eval set {eval_set.name!r}") for i, v in enumerate(values)]
    bad = next((i for i, s in enumerate(scores) if not math.isfinite(s)), None)
    if bad is not None:
        raise EvalFailed(f"the scorer of eval set {eval_set.name!r} gave completion {bad} the score {scores[bad]}, "
                         f"not a finite number")
    return scores


class EvalEngine:
    """The evaluator's engines, holding one version: ``sampler`` samples (the run's kind of engine) and
    ``scorer`` gives a greedy evaluation's rows the policy's own log-probs (teacher-forced, temperature
    1): the sampler itself where it scores (our loop), else our loop over a CPU copy of the version;
    None for a sampled evaluation, whose rows keep the log-probs they were sampled with. A vLLM
    server returns the log-probs of the distribution it sampled from (``--logprobs-mode
    processed_logprobs``, which training needs), 0 for every greedy token, and scores no given tokens."""

    def __init__(self, sampler: Any, scorer: Any | None) -> None:
        self.sampler, self.scorer = sampler, scorer

    @property
    def name(self) -> str:
        return self.sampler.name

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        self.sampler.load_weights(state, version)
        if self.scorer is not None and self.scorer is not self.sampler:
            self.scorer.load_weights(state, version)

    def close(self) -> None:
        try:
            self.sampler.close()
        finally:
            if self.scorer is not None and self.scorer is not self.sampler:
                self.scorer.close()

    def __enter__(self) -> EvalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def eval_engine(generation: Any, make_model: Callable[[], Any], tokenizer: Any, state: Mapping[str, Any],
                version: int, *, device: str = "cpu", seed: int = 0, greedy: bool = True) -> EvalEngine:
    """The engine the run's collectors sample with (``generation.*``: our loop, a vLLM server of its
    own, or the server at ``generation.url``), obtained as they obtain theirs
    (``generation.settings.make_engine``), holding ``state`` as ``version``.

    A server at ``generation.url`` is shared with the collectors: each chunk of an evaluation holds its
    weights lease (``generation/vllm_url_weights.py``), so the version evaluated is loaded for those
    requests only, and a reply is kept only if no other weights went in under it. ``device``: where an
    owned vLLM runs (the run's device); our loop runs on ``make_model``'s. ``greedy``: the evaluation
    is greedy (``eval.temperature`` 0), so its rows need a scorer (:class:`EvalEngine`)."""
    from rlhf_pipeline.generation.engine import EngineFailed
    from rlhf_pipeline.generation.loop import LoopEngine
    from rlhf_pipeline.generation.settings import CHOSEN_BY, make_engine

    model = make_model()
    model.load_state_dict(state)
    try:
        sampler = make_engine(generation, model, pad_token_id=tokenizer.pad_token_id,
                              stop_token_ids=[tokenizer.eos_token_id], device=device, policy_version=version,
                              seed=seed, tokenizer=tokenizer)
    except (ValueError, EngineFailed) as exc:  # checked as the collectors' engine is, said in one line
        raise EvalEngineUnavailable(f"the evaluator's engine ({CHOSEN_BY[generation.chosen_engine]}): {exc}") from None
    if sampler.supports_scoring or not greedy:
        return EvalEngine(sampler, sampler if sampler.supports_scoring else None)
    return EvalEngine(sampler, LoopEngine(model, pad_token_id=tokenizer.pad_token_id,
                                          eos_token_id=[tokenizer.eos_token_id], policy_version=version))
