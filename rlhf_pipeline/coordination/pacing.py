"""Collector pacing: a collector generates what the learner's next ``max_lag`` batches need, with
weights at most ``max_lag`` versions behind those that train them, and no more.

:class:`PacingPublisher` (the learner) rewrites ``<run>/pacing.json`` after every batch it takes in;
:class:`CollectorPacer` (a collector) allows a round from it and names the policy version the round
samples with, a function of the learner's intakes, never of timing. The file's fields, why it
cannot deadlock and which weights a round uses: docs/architecture.md#pacing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_pipeline.coordination.weights import latest_version
from rlhf_pipeline.files.run_store import RunStore, state_store_and_key
from rlhf_pipeline.files.shard_names import is_import_shard, shard_key_of

FORMAT_VERSION = 2  # 2: ``next_version``, and in each ``recent`` draw


def shard_key(store_path: str | Path, buffer: str | Path) -> str:
    """The key of a collector's store in ``consumed``: its shard's name (``shard-0000``; at an
    object-store URL ``70-shard-0007``), or ``"."`` when the buffer is itself the store (runs made
    before shards); the learner names shards the same way (``learn/shard_rows.py``)."""
    return "." if str(store_path).rstrip("/") == str(buffer).rstrip("/") else shard_key_of(store_path)


def buffer_rows_key(key: str) -> str:
    """A shard's key in a checkpoint's ``buffer_rows`` (``learn/checkpoint.buffer_rows``) from its
    :func:`shard_key`: the same name, but ``""`` for a single-store buffer."""
    return "" if key == "." else key


@dataclass
class LearnerIntake:
    """What the learner has taken in, as published in ``pacing.json``."""

    step: int = 0
    draws: int = 0
    consumed: dict[str, int] = field(default_factory=dict)
    next_draw_rows: int = 0
    waiting_since: float | None = None
    waiting_seen: float | None = None
    """The last time the learner said it was still waiting (renewed while it waits)."""
    policy_version: int = 0
    """The learner's weights when it took this batch in (its newest published version)."""
    next_version: int = 0
    """The weights the learner's next draw trains with: ``policy_version``, plus one when the step
    this batch trains publishes (``max_lag=0`` samples the next draw's rows with it)."""
    recent: list[tuple[int, int, int, dict[str, int]]] = field(default_factory=list)
    """``(policy_version, next_version, next_draw_rows, consumed)`` of the last draws, this one
    included, oldest first."""
    lacking: tuple[int, int, dict[str, int]] | None = None
    """While the learner waits, from a sampler that says it (``exact``): ``(the policy version the draw
    it waits for trains with, the rows that draw lacks, the rows per shard the sampler has seen)``;
    0 rows: it has them and is reading them. None: not waiting, or a sampler that does not say."""
    last_step: bool = False
    """This batch is the run's last step (or the learner has taken all its steps): no more draws."""
    taken_since_checkpoint: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    """``(draws, consumed)`` of every draw taken in since the learner's last checkpoint, oldest first:
    a learner resumed from that checkpoint takes the same rows into those draws again, whatever the
    shards hold by then (``retake`` of the ``exact`` sampler; docs/learner.md#resume-beside-several-collectors)."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "step": self.step, "draws": self.draws,
                "consumed": dict(self.consumed), "next_draw_rows": self.next_draw_rows,
                "waiting_since": self.waiting_since, "waiting_seen": self.waiting_seen,
                "policy_version": self.policy_version, "next_version": self.next_version,
                "last_step": self.last_step,
                "recent": [[version, next_version, need, dict(consumed)]
                           for version, next_version, need, consumed in self.recent],
                "lacking": None if self.lacking is None else [*self.lacking[:2], dict(self.lacking[2])],
                "taken_since_checkpoint": [[draws, dict(consumed)] for draws, consumed in self.taken_since_checkpoint]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerIntake:
        return cls(step=int(data["step"]), draws=int(data["draws"]),
                   consumed={str(k): int(v) for k, v in data["consumed"].items()},
                   next_draw_rows=int(data["next_draw_rows"]), waiting_since=data.get("waiting_since"),
                   waiting_seen=data.get("waiting_seen"),
                   policy_version=int(data.get("policy_version", 0)),
                   next_version=int(data.get("next_version", data.get("policy_version", 0))),
                   last_step=bool(data.get("last_step", False)),
                   recent=[_recent_entry(entry) for entry in data.get("recent", [])],
                   lacking=None if data.get("lacking") is None else _lacking_entry(data["lacking"]),
                   taken_since_checkpoint=[(int(draws), {str(k): int(n) for k, n in consumed.items()})
                                           for draws, consumed in data.get("taken_since_checkpoint", [])])


def _lacking_entry(entry) -> tuple[int, int, dict[str, int]]:
    """``(policy_version, rows, rows per shard)`` as ``lacking`` holds them."""
    version, rows, per_shard = entry
    return int(version), int(rows), {str(k): int(n) for k, n in per_shard.items()}


def _recent_entry(entry) -> tuple[int, int, int, dict[str, int]]:
    """A ``recent`` draw; one of a checkpoint made before ``next_version`` names none: its own version."""
    if len(entry) == 3:
        entry = [entry[0], *entry]
    version, next_version, rows, per_shard = entry
    return int(version), int(next_version), int(rows), {str(k): int(n) for k, n in per_shard.items()}


def read_intake(path: str | Path, *, store: RunStore | None = None) -> LearnerIntake | None:
    """The learner's last published intake, or None before its first publish. ``store``: the run's
    store when it lives at a URL (``path`` is then the key)."""
    where, key = state_store_and_key(path, store)
    return _parsed(where.read(key))


def _parsed(raw: bytes | None) -> LearnerIntake | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # replaced atomically, so only a file written by something else: ignore it
    if data.get("format") != FORMAT_VERSION:
        return None
    return LearnerIntake.from_json(data)


def _with_draw(taken: list[tuple[int, dict[str, int]]], draws: int,
               consumed: dict[str, int]) -> list[tuple[int, dict[str, int]]]:
    """``taken`` with draw ``draws`` taken in. A draw taken again as recorded keeps the record of the
    draws after it (a resumed learner killed again before it took them all in must take them still); one
    that took other rows ends it there."""
    recorded = dict(taken).get(draws)
    later = [(d, c) for d, c in taken if d > draws] if recorded == consumed else []
    return [(d, c) for d, c in taken if d < draws] + [(draws, dict(consumed))] + later


WAITING_RENEW_S = 0.5
"""How often a waiting learner renews ``waiting_seen``: at a URL, one PUT each time."""

WAIT_REPORT_S = 60.0
"""A collector that has written no round for this long says in one line what it waits for."""

RECENT_DRAWS = 32
"""Draws kept in ``recent``: a collector that missed this many publishes in a row (it was busy
generating) can no longer tell which one first allowed its round."""


class PacingPublisher:
    """Learner side: publishes its intake after each batch it uses, and when it starts waiting.

    ``write=False``: a learner no collector follows (a replay trains on a recorded buffer): it keeps
    its intake (``recent`` included) for its checkpoints as ever, and writes nothing, where it
    would write the file after every step (at a URL, a PUT each) for no reader."""

    def __init__(self, path: str | Path, *, store: RunStore | None = None, write: bool = True) -> None:
        self.path = path
        self._store, self._key = state_store_and_key(path, store)
        self.write = write
        self.intake = LearnerIntake()

    def publish(self, intake: LearnerIntake, *, new_draw: bool = True) -> None:
        """Publishes ``intake``; ``new_draw``: it follows a draw, which ``recent`` records."""
        if new_draw:
            entry = (intake.policy_version, intake.next_version, intake.next_draw_rows, dict(intake.consumed))
            intake.recent = (list(self.intake.recent) + [entry])[-RECENT_DRAWS:]
            if intake.draws:  # (a new learner's first publish follows no draw)
                intake.taken_since_checkpoint = _with_draw(self.intake.taken_since_checkpoint, intake.draws,
                                                           intake.consumed)
        self.intake = intake
        if not self.write:
            return
        payload = json.dumps(intake.to_json(), separators=(",", ":"), sort_keys=True).encode()
        self._store.write(self._key, payload, durable=False)

    def published(self) -> LearnerIntake | None:
        """What ``pacing.json`` holds: before this learner's first publish, the intake of the learner
        before it (one killed: the draws it took in since its checkpoint)."""
        return _parsed(self._store.read(self._key))

    def waiting(self, lacking: tuple[int, int, dict[str, int]] | None = None) -> None:
        """The learner is waiting for its next batch: called while it waits; publishes the time it
        began, then that it still waits at most every ``WAITING_RENEW_S``, and at once what its
        sampler says the draw ``lacking`` whenever that changes (:attr:`LearnerIntake.lacking`)."""
        now = time.time()
        since, seen = self.intake.waiting_since, self.intake.waiting_seen
        if since is None or seen is None or now - seen >= WAITING_RENEW_S or lacking != self.intake.lacking:
            self.publish(dataclasses.replace(self.intake, waiting_since=now if since is None else since,
                                             waiting_seen=now, lacking=lacking), new_draw=False)


@dataclass(frozen=True)
class RoundPlan:
    """What a collector does next (:meth:`CollectorPacer.plan_round`)."""

    allowed: bool
    """Pacing allows a round now (once ``min_version`` is loaded)."""
    version: int | None
    """The weights the round must use (poll exactly this version); None: the newest."""
    min_version: int
    """The round waits until the collector holds at least this version."""
    waiting_for: str
    """What it waits for when it cannot go yet, in words (the collector's line when it waits long)."""


class CollectorPacer:
    """Collector side: ``plan_round(rows_in_my_shard)`` says whether to generate a round now, and with
    which weights.

    ``max_lag=None`` turns pacing off (every round goes, with the newest weights).
    ``learner_expected=False`` leaves it off until a learner's first publish.
    """

    def __init__(self, path: str | Path, key: str, max_lag: int | None, *, round_rows: int | None = None,
                 stall_s: float = 1.0, learner_expected: bool = True, store: RunStore | None = None,
                 reread_s: float = 0.0) -> None:
        if max_lag is not None and max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 or None (got {max_lag})")
        self.path = path
        self._store = store
        # at a URL each read is a GET: one read serves the calls of one loop iteration
        self.reread_s = reread_s
        self._read_at = -math.inf
        self._intake: LearnerIntake | None = None
        self.key = key
        self.max_lag = max_lag
        self.stall_s = stall_s
        self.learner_expected = learner_expected
        # rows of one round: as the collector says (round_written updates it), else the most one
        # round has written so far
        self._configured_round_rows = round_rows
        self.round_rows = round_rows or 0
        self._last_round_at = time.time()

    def round_written(self, rows: int, round_rows: int | None = None) -> None:
        """A round appended ``rows`` rows (fewer than configured when groups were dropped);
        ``round_rows``: the collector's new estimate of a round's rows (an agent round's rows vary
        with its episodes' turns: ``Collector.round_rows``)."""
        if round_rows:
            self.round_rows = round_rows
        elif not self._configured_round_rows:
            self.round_rows = max(self.round_rows, rows)
        self._last_round_at = time.time()

    def target_rows(self, intake: LearnerIntake | None) -> float:
        """The rows this collector's shard may hold before it waits (inf: no limit): its share of the
        learner's next draw, and of ``max_lag - 1`` draws more."""
        if self.max_lag is None or not self.round_rows:
            return math.inf  # unpaced, or no round written yet: its size is unknown
        if intake is None:  # the learner's first draw trains with version 0, which the rounds sample with
            return max(self.max_lag, 1) * self.round_rows if self.learner_expected else math.inf
        if intake.last_step:  # rows past what it has taken in would never be trained on
            return intake.consumed.get(self.key, 0)
        return intake.consumed.get(self.key, 0) + max(self.max_lag, 1) * self._share(intake)

    def _share(self, intake: LearnerIntake) -> int:
        """This collector's share of the learner's next draw. A draw takes an even share from each shard
        with rows past its cursor (``learn/samplers/exact.py``), so a shard counts while it may give some:
        an import's (``files/shard_names.is_import_shard``) while the learner's last draw took rows from it,
        another collector's (slow, or not started yet) until it gave none through the ``RECENT_DRAWS`` draws
        on record (its collector has stopped: a run resumed with fewer collectors). Counted for good, such
        a shard left a lone collector a round short at every step, the learner waiting for the rest each
        time: max_lag=1 trained as 0."""
        taken = [consumed for *_, consumed in intake.recent]  # oldest first, this draw's last
        last = taken[-2] if len(taken) >= 2 else {}
        window = taken[0] if len(taken) >= RECENT_DRAWS else None
        supplying = {key for key, rows in intake.consumed.items()
                     if (rows > last.get(key, 0) if is_import_shard(key)
                         else window is None or rows > window.get(key, 0))}
        return math.ceil(intake.next_draw_rows / len(supplying | {self.key}))

    def version_for(self, intake: LearnerIntake, shard_rows: int) -> int:
        """The weights a round starting at ``shard_rows``, allowed by ``intake``, samples with: the
        oldest that keeps its last row (``round_rows`` on) within ``max_lag`` versions of the draw
        that trains it, a version a draw: the learner's when it took the batch in (the round overlaps
        its step), else the one its next draw trains with (waited for) -- never a later one, which
        the learner cannot publish without this round. So with 1 a round that crosses into the batch
        after next waits for the step in progress, and with 0 a round's tail in a later batch is a
        version too old (passed over: ``learner.max_staleness``)."""
        share = self._share(intake)
        last_row = shard_rows + max(self.round_rows, 1) - 1
        draws_on = (last_row - intake.consumed.get(self.key, 0)) // share if share else 0
        return max(intake.policy_version, min(intake.next_version, intake.next_version + draws_on - self.max_lag))

    def _read(self) -> LearnerIntake | None:
        now = time.monotonic()
        if now - self._read_at >= self.reread_s:
            self._intake, self._read_at = read_intake(self.path, store=self._store), now
        return self._intake

    def may_collect(self, shard_rows: int) -> bool:
        if self.max_lag is None:
            return True
        intake = self._read()
        if shard_rows < self.target_rows(intake):
            return True
        return self.lacked(intake, shard_rows) or self._stalled(intake)

    def within_target(self, shard_rows: int) -> bool:
        """The learner's intake alone allows a round starting at ``shard_rows`` (not the stall rule,
        which counts from this collector's last round: ``collect/collector.py`` asks before it ends)."""
        return shard_rows < self.target_rows(self._read())

    def lacked(self, intake: LearnerIntake | None, shard_rows: int) -> bool:
        """The draw the learner waits for lacks rows of this shard from ``shard_rows`` on (its share
        of the rows its sampler says it lacks, past the rows it has seen here)."""
        if intake is None or intake.lacking is None:
            return False
        _, rows, seen = intake.lacking
        # an import's shard has no row left to give (the learner would have taken it): collectors' rows only
        shards = len({key for key in seen if not is_import_shard(key)} | {self.key})
        return shard_rows < seen.get(self.key, 0) + math.ceil(rows / shards)

    def _stalled(self, intake: LearnerIntake | None) -> bool:
        if intake is None or intake.waiting_since is None or intake.waiting_seen is None:
            return False
        if intake.lacking is not None:  # its sampler says what it lacks: the clock decides nothing
            return False
        # the learner has waited for its next batch since before this collector's last round and
        # said it still waits well after it: it needs more than it said; one more round. Said, not
        # supposed from this clock: a learner that died waiting says nothing more
        return intake.waiting_seen - max(intake.waiting_since, self._last_round_at) > self.stall_s

    def plan_round(self, shard_rows: int) -> RoundPlan:
        """Whether a round starting at ``shard_rows`` may be written now, and with which weights:
        the version pinned by the first intake that allowed it (:meth:`version_for`), the one the
        learner's waiting draw trains with for a round that draw lacks, else the newest."""
        if self.max_lag is None:
            return RoundPlan(True, None, 0, "")
        intake = self._read()
        if shard_rows >= self.target_rows(intake) and not self._stalled(intake):
            if self.lacked(intake, shard_rows):  # the draw it waits for needs it: with the version it trains with
                version = intake.lacking[0]
                return RoundPlan(True, version, version, f"waiting for policy version {version}, the one the "
                                 f"learner's waiting draw trains with")
            if intake is not None and intake.last_step:
                return RoundPlan(False, None, 0, "the learner has taken in the batch of its last step: "
                                                 "waiting for the run to stop")
            taken = intake.consumed.get(self.key, 0) if intake is not None else 0
            return RoundPlan(False, None, 0,
                             f"the shard holds {shard_rows} rows, {shard_rows - taken} past what the learner has "
                             f"taken in, as many as its next batches within max_lag={self.max_lag} ask for: "
                             f"waiting for the learner to take rows in")
        version = self._pinned_version(intake, shard_rows)
        if version is not None:
            return RoundPlan(True, version, version,
                             f"waiting for policy version {version}, the one pacing names for this round "
                             f"(max_lag={self.max_lag})")
        return RoundPlan(True, None, 0, "")  # no intake yet, the stall rule, or too old: the newest

    def next_round_goes_ahead(self, weights: RunStore | Path, *, shard_rows: int, rows_to_come: int,
                              policy_version: int) -> bool:
        """Whether the round after the current one (started with ``policy_version``) may go to the
        engine while this one's tail decodes: only when pacing would start it the same way, with the
        weights held, however the current round ends. Pacing must allow it both if every row still to
        come (``rows_to_come``, beside the shard's ``shard_rows`` now) is written and if dynamic sampling
        drops them all (the next round starts between the two), and not by the stall rule alone, which
        counts from a round not ended. A round pinned to a version takes it only when held; one that
        takes the newest only when ``weights`` holds none newer. ``docs/architecture.md#pacing``."""
        plans = [self.plan_round(rows) for rows in (shard_rows, shard_rows + rows_to_come)]
        if not all(plan.allowed and plan.min_version <= policy_version for plan in plans):
            return False
        if self.max_lag is not None and not self.within_target(shard_rows + rows_to_come):
            return False
        if len({plan.version for plan in plans}) != 1:
            return False
        if plans[0].version is not None:
            return plans[0].version <= policy_version
        newest = latest_version(weights)
        return newest is None or newest <= policy_version

    def _pinned_version(self, intake: LearnerIntake | None, shard_rows: int) -> int | None:
        """The version :meth:`version_for` names from the first intake in ``recent`` that allowed the
        round; None when there is none."""
        if intake is None:
            return None
        for index, (version, next_version, need, consumed) in enumerate(intake.recent):
            # draws before the newest were not the run's last step (and the last allows no new round)
            earlier = dataclasses.replace(intake, consumed=consumed, next_draw_rows=need, last_step=False,
                                          policy_version=version, next_version=next_version,
                                          recent=intake.recent[:index + 1])
            if shard_rows < self.target_rows(earlier):
                return self.version_for(earlier, shard_rows)
        return None
