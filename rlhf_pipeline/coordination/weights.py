"""Policy weights travelling from the learner back to collectors, as versioned files.

The learner publishes ``<run>/weights/policy_XXXXXXXX.safetensors`` (a CPU ``state_dict``, its
version in the file's metadata) with a version that only increases; the file is written to
``*.partial`` and renamed, so a reader never sees half a file (at a URL: one PUT that creates the
object, ``files/run_store.py``). Collectors poll with
:class:`WeightsPoller` between rounds and load the newest version. Old versions are pruned (keep
the last few) because a reader always wants the newest; a reader that loses a race with the
pruning simply polls again. Version 0, the initial policy, is kept until the learner's first
checkpoint: a learner killed before one starts again from it.

A version's number follows from the learner's progress (one more per publish), whatever happened
to its process: a learner killed after its checkpoint had published versions past it, which the resumed learner
takes back (:func:`retract_versions_after`) and publishes again under the same numbers as it
retrains those steps. Rows sampled with them keep their number, so staleness and the versions
collectors pin their rounds to mean what they meant before the kill (``learn/learner.py``).

At a URL, the collectors of one machine share one download per version
(``WeightsPoller(..., cache=MachineCache(paths.fetched_weights))``, ``files/machine_cache.py``):
the poll's listing names each object's etag, the first collector to want a version GETs it into
the machine's cache, the others load that file. Under ``--ray`` weights travel through Ray's object
store instead (``cluster/actors.py``), which already moves one copy per node.

Why safetensors: a collector loads every version the learner publishes, one per learner step
by default, and ``torch.load(weights_only=True)`` of the default model's 0.6 MB took 4-5.5 ms
against 1.3-1.7 ms (``benchmarks/bench_step_overhead.py``; writing costs about the same in
both); like ``weights_only`` it runs no code from the file. Runs made before hold
``policy_XXXXXXXX.pt`` files (a torch pickle of ``{"version", "state_dict"}``): they are still
read, and a resumed run publishes its next versions as safetensors beside them.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_pipeline.files.machine_cache import MachineCache
from rlhf_pipeline.files.run_store import LocalRunStore, RunStore, as_run_store

if TYPE_CHECKING:  # imported where used, so listing versions (export-model --list-versions) needs no torch
    import torch

SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"  # runs made before safetensors
WEIGHTS = "weights"  # the key prefix of the weight objects in a run
_NAME = re.compile(r"^policy_(\d{8,})(\.safetensors|\.pt)$")

Run = str | Path | RunStore
"""A run directory, or a run's store (``RunPaths.store``: a directory or a URL)."""


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / WEIGHTS


def _files(run: Run, names: list[str] | None = None) -> dict[int, str]:
    """The weight object's name of each published version (safetensors where a version has both);
    ``names``: the listing of ``weights/`` when the caller has it."""
    found: dict[int, str] = {}
    for name in as_run_store(run).list(WEIGHTS) if names is None else names:
        match = _NAME.match(name)
        if match and (match.group(2) == SUFFIX or int(match.group(1)) not in found):
            found[int(match.group(1))] = name
    return found


def published_objects(run: Run) -> dict[int, str]:
    """The weights object's name (in ``weights/``) of each published version."""
    return _files(run)


def published_versions(run: Run) -> list[int]:
    """Every version published in ``run``, oldest first."""
    return sorted(_files(run))


def latest_version(run: Run) -> int | None:
    """The newest published version, or ``None`` when nothing is published yet."""
    versions = published_versions(run)
    return versions[-1] if versions else None


def weights_path(run_dir: str | Path, version: int) -> Path:
    """The file of ``version`` in a run directory: the one on disk (either format), else where a
    publish writes it."""
    name = _files(run_dir).get(version) or f"policy_{version:08d}{SUFFIX}"
    return weights_dir(run_dir) / name


def weights_location(run: Run, version: int) -> str:
    """Where ``version`` is (a path or a URL), for messages; as :func:`weights_path`."""
    store = as_run_store(run)
    return store.describe(f"{WEIGHTS}/{_files(store).get(version) or f'policy_{version:08d}{SUFFIX}'}")


def publish_weights(run: Run, state_dict: dict[str, torch.Tensor], version: int,
                    keep_last: int = 3, *, keep_versions: Collection[int] = ()) -> str:
    """Writes ``state_dict`` as ``version``; ``version`` must exceed every published one. At a URL
    the version is created, never overwritten: a second learner publishing it is refused. The
    newest ``keep_last`` versions and ``keep_versions`` stay, older ones are pruned."""
    from safetensors.torch import save

    store = as_run_store(run)
    listed = store.list(WEIGHTS)  # one listing: the newest version, then what to prune
    files = _files(store, listed)
    current = max(files, default=None)
    if current is not None and version <= current:
        raise ValueError(
            f"weights version {version} is not newer than the published version {current}; "
            "versions only increase"
        )
    name = f"policy_{version:08d}{SUFFIX}"
    # own copies: safetensors refuses tensors that share memory (tied embeddings), and a GPU
    # model's tensors must come to the CPU anyway
    cpu_state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
    payload = save(cpu_state, metadata={"version": str(version)})
    store.create(f"{WEIGHTS}/{name}", payload)
    files[version] = name
    for old in sorted(files)[:-keep_last]:
        if old in keep_versions:
            continue
        store.delete(f"{WEIGHTS}/{files[old]}")
        legacy = Path(files[old]).with_suffix(LEGACY_SUFFIX).name
        if legacy in listed and legacy != files[old]:  # an older run's file beside it (a request less at a URL)
            store.delete(f"{WEIGHTS}/{legacy}")
    return store.describe(f"{WEIGHTS}/{name}")


def retract_versions_after(run: Run, version: int) -> list[int]:
    """Deletes every version published after ``version``, newest first, and returns them oldest
    first. What a resumed learner calls with its checkpoint's version: a learner killed after that
    checkpoint published these from steps the resumed one takes again, and it publishes them again
    under the same numbers (the numbers rows in the buffer carry), so until it has, no collector
    loads them. Newest first: a crash midway leaves published versions without a gap."""
    store = as_run_store(run)
    names = [name for name in store.list(WEIGHTS) if (match := _NAME.match(name)) and int(match.group(1)) > version]
    names.sort(key=lambda name: int(_NAME.match(name).group(1)), reverse=True)
    for name in names:  # a version's safetensors and legacy .pt files alike
        store.delete(f"{WEIGHTS}/{name}")
    return sorted({int(_NAME.match(name).group(1)) for name in names})


def load_weights_file(path: str | Path) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` from one weight file of either format."""
    path = Path(path)
    if path.suffix == LEGACY_SUFFIX:
        import torch

        payload = torch.load(path, map_location="cpu", weights_only=True)
        return payload["state_dict"], int(payload["version"])
    from safetensors import safe_open

    state = {}
    with safe_open(str(path), framework="pt", device="cpu") as weights:
        named = _NAME.match(path.name)
        version = int((weights.metadata() or {}).get("version") or (named.group(1) if named else -1))
        for name in weights.keys():
            state[name] = weights.get_tensor(name)
    return state, version


def _load_object(store: RunStore, name: str) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` of the weight object ``name``; FileNotFoundError when pruned."""
    if isinstance(store, LocalRunStore):
        return load_weights_file(store.path(f"{WEIGHTS}/{name}"))
    data = store.read(f"{WEIGHTS}/{name}")
    if data is None:
        raise FileNotFoundError(store.describe(f"{WEIGHTS}/{name}"))
    named = _NAME.match(name)
    if name.endswith(LEGACY_SUFFIX):
        from rlhf_pipeline.files.state_files import load_state_bytes

        payload = load_state_bytes(data, what="weights file", where=store.describe(f"{WEIGHTS}/{name}"))
        return payload["state_dict"], int(payload["version"])
    from safetensors.torch import load

    (header_size,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + header_size]).get("__metadata__") or {}
    version = int(metadata.get("version") or (named.group(1) if named else -1))
    return load(data), version


def load_weights(run: Run, version: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` of ``version`` (default: the newest)."""
    store = as_run_store(run)
    files = _files(store)
    if version is None:
        if not files:
            raise FileNotFoundError(f"no published weights under {store.describe(WEIGHTS)}")
        version = max(files)
    if version not in files:
        raise FileNotFoundError(f"weights version {version} is not under {store.describe(WEIGHTS)}")
    return _load_object(store, files[version])


class WeightsPoller:
    """Collector side: ``poll()`` returns the newest weights once, when a newer version appears.

    ``cache``: for a run at a URL, this machine's shared copies (one GET per version per machine
    instead of one per collector); ignored for a run directory, whose files are read in place."""

    def __init__(self, run: Run, current_version: int = -1, *, cache: MachineCache | None = None) -> None:
        self.store = as_run_store(run)
        self.current_version = current_version
        self.cache = None if self.store.is_local else cache

    def _listing(self) -> tuple[dict[int, str], dict[str, str]]:
        """Each version's object name, and each object's etag when there is a cache (the same one LIST)."""
        if self.cache is None:
            return _files(self.store), {}
        etags = self.store.list_etags(WEIGHTS)
        return _files(self.store, list(etags)), etags

    def _load(self, name: str, etags: dict[str, str]) -> tuple[dict[str, torch.Tensor], int]:
        if self.cache is None:
            return _load_object(self.store, name)
        return load_weights_file(self.cache.fetch(self.store, f"{WEIGHTS}/{name}", etags[name]))

    def poll(self) -> tuple[dict[str, torch.Tensor], int] | None:
        """Called between rounds, and every millisecond or so while a paced collector waits: one
        directory listing, and a load only when a newer version is there."""
        files, etags = self._listing()
        newest = max(files, default=None)
        if newest is None or newest <= self.current_version:
            return None
        try:
            state, version = self._load(files[newest], etags)
        except FileNotFoundError:  # pruned between listing and loading: a newer one exists
            return self.poll()
        self.current_version = version
        return state, version

    def poll_version(self, version: int) -> tuple[dict[str, torch.Tensor], int] | None:
        """``version`` once it is published and newer than the current one, else None; the newest
        when ``version`` was pruned already (a paced collector asks for a set version, pacing.py)."""
        files, etags = self._listing()
        if version <= self.current_version or not files or version > max(files):
            return None
        if version not in files:
            return self.poll()
        try:
            state, loaded = self._load(files[version], etags)
        except FileNotFoundError:  # pruned between listing and loading
            return self.poll()
        self.current_version = loaded
        return state, loaded
