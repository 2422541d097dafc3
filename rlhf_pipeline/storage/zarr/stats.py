"""``stats()`` of a Zarr trajectory store: row, token and byte counts from its small arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rlhf_pipeline.storage.base import StoreStats
from rlhf_pipeline.storage.zarr.layout import NP_DTYPE_BY_NAME, UNITS_PREFIX
from rlhf_pipeline.storage.zarr.location import ROOT_META

if TYPE_CHECKING:
    from rlhf_pipeline.storage.zarr.store import ZarrTrajectoryStore


def store_stats(store: ZarrTrajectoryStore) -> StoreStats:
    """Summary of the published units (the caller has waited for background work and refreshed)."""
    row_names = [s.name for s in store._schema.fields if s.kind == "row"]
    offsets = [s.name for s in store._arrays if s.length_of == "rows+1"]
    group_ids, rewards, versions = [], [], []
    prompt_tokens = response_tokens = raw = 0
    itemsize = {s.name: NP_DTYPE_BY_NAME[s.dtype].itemsize for s in store._arrays}
    for unit in store._units:
        decoded = store._light_unit(unit, row_names + offsets)
        group_ids.append(decoded["group_id"])
        rewards.append(decoded["reward"])
        versions.append(decoded["policy_version"])
        p = int(decoded["prompt_offsets"][-1])
        r = int(decoded["response_offsets"][-1])
        prompt_tokens += p
        response_tokens += r
        for spec in store._arrays:
            if spec.length_of == "rows":
                raw += unit.rows * itemsize[spec.name]
            elif spec.length_of != "rows+1":
                raw += int(decoded[spec.length_of][-1]) * itemsize[spec.name]
    reward = np.concatenate(rewards) if rewards else np.zeros(0, np.float32)
    version_values, version_counts = np.unique(np.concatenate(versions), return_counts=True) if versions \
        else (np.zeros(0), np.zeros(0))
    on_disk = store._loc.kv.size_of(UNITS_PREFIX) + len(store._loc.kv.get(ROOT_META) or b"")
    return StoreStats(
        backend="zarr", location=store._location, rows=store._published_len(), first_row=store._first_row,
        next_row=store._next_row, groups=int(np.unique(np.concatenate(group_ids)).size) if group_ids else 0,
        prompt_tokens=prompt_tokens, response_tokens=response_tokens, bytes_on_disk=on_disk, raw_bytes=raw,
        segments=sum(u.sealed for u in store._units) + int(any(not u.sealed for u in store._units)),
        reward_mean=float(reward.mean()) if reward.size else None,
        reward_std=float(reward.std()) if reward.size else None,
        reward_min=float(reward.min()) if reward.size else None,
        reward_max=float(reward.max()) if reward.size else None,
        policy_versions={int(v): int(c) for v, c in zip(version_values, version_counts)},
        optional_fields=list(store._schema.optional),
        extra={"codec": store._codec.config, "segment_rows": store._segment_rows,
               "tail_fragments": sum(not u.sealed for u in store._units),
               "capacity_rows": store._capacity_rows, "zarr_format": 3,
               "cache_bytes": store._cache.capacity_bytes, "cached_bytes": store._cache.nbytes},
    )
