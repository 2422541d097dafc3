"""Policy weights travelling from the learner back to collectors, as versioned files.

The learner publishes ``<run>/weights/policy_XXXXXXXX.pt`` (a CPU ``state_dict``) with a
version that only increases; the file is written to ``*.partial`` and renamed, so a reader
never sees half a file. Collectors poll with :class:`WeightsPoller` between rounds and load
the newest version. Old versions are pruned (keep the last few) because a reader always
wants the newest; a reader that loses a race with the pruning simply polls again.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from rlhf_pipeline.atomic import save_torch_atomic

_NAME = re.compile(r"^policy_(\d{8,})\.pt$")


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def _versions(run_dir: str | Path) -> list[int]:
    directory = weights_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def latest_version(run_dir: str | Path) -> int | None:
    """The newest published version, or ``None`` when nothing is published yet."""
    versions = _versions(run_dir)
    return versions[-1] if versions else None


def weights_path(run_dir: str | Path, version: int) -> Path:
    return weights_dir(run_dir) / f"policy_{version:08d}.pt"


def publish_weights(run_dir: str | Path, state_dict: dict[str, torch.Tensor], version: int,
                    keep_last: int = 3) -> Path:
    """Writes ``state_dict`` as ``version``; ``version`` must exceed every published one."""
    current = latest_version(run_dir)
    if current is not None and version <= current:
        raise ValueError(
            f"weights version {version} is not newer than the published version {current}; "
            "versions only increase"
        )
    final = weights_path(run_dir, version)
    cpu_state = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
    save_torch_atomic({"version": version, "state_dict": cpu_state}, final,
                      partial_name=f"{final.name}.{os.getpid()}.partial")
    for old in _versions(run_dir)[:-keep_last]:
        weights_path(run_dir, old).unlink(missing_ok=True)
    return final


def load_weights(run_dir: str | Path, version: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` of ``version`` (default: the newest)."""
    if version is None:
        version = latest_version(run_dir)
        if version is None:
            raise FileNotFoundError(f"no published weights under {weights_dir(run_dir)}")
    payload = torch.load(weights_path(run_dir, version), map_location="cpu", weights_only=True)
    return payload["state_dict"], int(payload["version"])


class WeightsPoller:
    """Collector side: ``poll()`` returns the newest weights once, when a newer version appears."""

    def __init__(self, run_dir: str | Path, current_version: int = -1) -> None:
        self.run_dir = Path(run_dir)
        self.current_version = current_version

    def poll(self) -> tuple[dict[str, torch.Tensor], int] | None:
        newest = latest_version(self.run_dir)
        if newest is None or newest <= self.current_version:
            return None
        try:
            state, version = load_weights(self.run_dir, newest)
        except FileNotFoundError:  # pruned between listing and loading: a newer one exists
            return self.poll()
        self.current_version = version
        return state, version
