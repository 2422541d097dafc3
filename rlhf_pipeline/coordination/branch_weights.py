"""Which published weights versions a learner keeps for branches: a branch continued online from a kept
step restarts each collector where it stood at the step's rows, and samples with the versions its
parent's collectors used from there (:func:`weights_for_branches`, from the versions the collectors
held: :class:`HeldVersions`). Design: docs/branching.md#continuing-online.
"""

from __future__ import annotations


def held_version(state: dict | None) -> int | None:
    """The policy version a collector's state (or a checkpoint's rewind record) says it held, else None."""
    version = (state or {}).get("policy_version")
    return int(version) if isinstance(version, int) and not isinstance(version, bool) else None


class HeldVersions:
    """What the collectors of a buffer of shards held when they published the rows a reader sees:
    calling it on a buffer gives shard name -> ``(its rows, the policy version in the collector state
    published with them)`` (``storage/writer_state.py``), as of the reader's last refresh. Shards with
    no state yet, and a buffer without shards, give none. Each published state is decoded once.

    What the learner keeps weights for, so that a branch from a kept step samples with the versions
    its parent's collectors used (docs/branching.md#continuing-online)."""

    def __init__(self) -> None:
        self._decoded: dict[str, tuple[bytes, int | None]] = {}

    def __call__(self, buffer) -> dict[str, tuple[int, int]]:
        from rlhf_pipeline.storage import writer_state as writer_states

        if getattr(buffer, "shards", None) is None:
            return {}
        # copies: the reader's prefetch thread may add a shard meanwhile (one missing here is seen next time)
        shards, names = buffer.shards, buffer.shard_names
        held = {}
        for index, shard in shards.items():
            name, data = names.get(index), shard.writer_state
            rows = int(shard.next_row)  # read after the state: at least the rows published with it
            if name is None or data is None:
                continue
            if self._decoded.get(name, (None,))[0] is not data:
                published = writer_states.decode(data, shard.location)
                self._decoded[name] = (data, held_version(published["writer"]))
            if (version := self._decoded[name][1]) is not None:
                held[name] = (rows, version)
        return held


def weights_for_branches(records: list[dict], held_now: dict[str, tuple[int, int]], newest: int) -> set[int]:
    """The versions up to ``newest`` a learner keeps so that a branch continued online from any kept step
    samples with its parent's: a branch restarts each collector where it stood at the step's rows, and
    its next rounds use the versions the parent's did, from the one that collector held there up to the
    checkpoint's (docs/branching.md#continuing-online). ``records``: the kept checkpoints' rewind
    records, oldest first (their ``held_versions``, ``buffer_rows`` and ``policy_version``);
    ``held_now``: :class:`HeldVersions` of the learner's buffer now, whose rows the next checkpoint may
    name. A collector that wrote nothing since the checkpoint before (stopped, or gone) keeps only the
    version it holds: it samples with no other."""
    keep: set[int] = set()
    before: dict[str, int] = {}
    for record in records:
        rows = {name: int(count) for name, count in (record.get("buffer_rows") or {}).items()}
        held, version = record.get("held_versions"), record.get("policy_version")
        if isinstance(held, dict) and isinstance(version, int):
            for name, oldest in held.items():
                wrote = rows.get(name, 0) > before.get(name, 0)
                keep.update(range(int(oldest), version + 1) if wrote else (int(oldest),))
        before = rows
    writing = [version for name, (rows, version) in held_now.items() if rows > before.get(name, 0)]
    if writing:
        keep.update(range(min(writing), newest + 1))
    return keep
