"""Policy weights from the learner back to the collectors, as versioned safetensors files.

The learner publishes ``<run>/weights/policy_XXXXXXXX.safetensors`` atomically with a version that
follows its progress (a resumed learner retracts and republishes versions past its checkpoint);
collectors poll with :class:`WeightsPoller`. Design: docs/architecture.md#published-weights.

In a LoRA run (docs/lora.md) version 0 is the base's whole weights and every later version an adapter
alone. :func:`load_weights` gives any version as whole weights (an adapter merged into version 0);
:class:`WeightsPoller` hands an engine the adapter itself, its base attached when the engine lacks it.
Every read checks the CRC32C a file records of itself (:func:`weights_checksum`).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_pipeline.files.machine_cache import MachineCache
from rlhf_pipeline.files.run_store import LocalRunStore, RunStore, as_run_store
from rlhf_pipeline.files.state_files import StateFileError, damaged

if TYPE_CHECKING:  # imported where used, so listing versions (export-model --list-versions) needs no torch
    import torch

SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"  # runs made before safetensors
WEIGHTS = "weights"  # the key prefix of the weight objects in a run
_NAME = re.compile(r"^policy_(\d{8,})(\.safetensors|\.pt)$")
CHECKSUM_KEY = "crc32c"  # in a weights file's metadata; files published before it are read unchecked

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


def published_name(version: int) -> str:
    """The name a publish gives ``version``'s object in ``weights/``."""
    return f"policy_{version:08d}{SUFFIX}"


def weights_path(run_dir: str | Path, version: int) -> Path:
    """The file of ``version`` in a run directory: the one on disk (either format), else where a
    publish writes it."""
    name = _files(run_dir).get(version) or published_name(version)
    return weights_dir(run_dir) / name


def publish_weights(run: Run, state_dict: dict[str, torch.Tensor], version: int,
                    keep_last: int = 3, *, keep_versions: Collection[int] = (),
                    listing: list[str] | None = None) -> str:
    """Writes ``state_dict`` (whole weights, or a ``PolicyAdapter``) as ``version``; ``version`` must
    exceed every published one. At a URL the version is created, never overwritten: a second learner
    publishing it is refused. The newest ``keep_last`` versions and ``keep_versions`` stay, older ones
    are pruned (an adapter run keeps version 0, its base, for ever). ``listing``: the caller's own
    listing of ``weights/``, kept up to date here, in place of a LIST request each time: the learner's,
    which alone publishes and prunes while it runs."""
    from rlhf_pipeline.models.lora import PolicyAdapter

    from safetensors.torch import save

    store = as_run_store(run)
    listed = store.list(WEIGHTS) if listing is None else listing  # the newest version, then what to prune
    files = _files(store, listed)
    current = max(files, default=None)
    if current is not None and version <= current:
        raise ValueError(
            f"weights version {version} is not newer than the published version {current}; "
            "versions only increase"
        )
    name = published_name(version)
    # own copies: safetensors refuses tensors that share memory (tied embeddings), and a GPU
    # model's tensors must come to the CPU anyway
    cpu_state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
    metadata = state_dict.metadata() if isinstance(state_dict, PolicyAdapter) else {}
    metadata = {**metadata, "version": str(version)}
    payload = save(cpu_state, metadata={**metadata, CHECKSUM_KEY: weights_checksum(cpu_state, metadata)})
    store.create(f"{WEIGHTS}/{name}", payload)
    listed.append(name)
    prune_versions(store, keep_last, keep_versions=keep_versions, listing=listed)
    return store.describe(f"{WEIGHTS}/{name}")


def prune_versions(run: Run, keep_last: int = 3, *, keep_versions: Collection[int] = (),
                   listing: list[str] | None = None) -> list[str]:
    """Deletes every published version but the newest ``keep_last`` and ``keep_versions``; returns the
    names deleted. ``listing``: as in :func:`publish_weights`, kept up to date here."""
    store = as_run_store(run)
    listed = store.list(WEIGHTS) if listing is None else listing
    files = _files(store, listed)
    gone = []
    for old in sorted(files)[:-keep_last]:
        if old in keep_versions:
            continue
        store.delete(f"{WEIGHTS}/{files[old]}")
        gone.append(files[old])
        legacy = Path(files[old]).with_suffix(LEGACY_SUFFIX).name
        if legacy in listed and legacy != files[old]:  # an older run's file beside it (a request less at a URL)
            store.delete(f"{WEIGHTS}/{legacy}")
            gone.append(legacy)
    if listing is not None:
        listing[:] = [kept for kept in listing if kept not in gone]
    return gone


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


def weights_checksum(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """CRC32C over the metadata (its version, an adapter's settings) and each tensor's name, dtype,
    shape and bytes: what a weights file records of itself. safetensors keeps no checksum, so a bit
    flipped on disk would load as it is and be sampled with (0.15-0.27 s per 512 MiB of tensors here)."""
    import google_crc32c
    import torch

    checked = {key: value for key, value in metadata.items() if key != CHECKSUM_KEY}
    crc = google_crc32c.value(json.dumps(checked, sort_keys=True).encode())
    for name in sorted(state):
        tensor = state[name]
        crc = google_crc32c.extend(crc, f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        crc = google_crc32c.extend(crc, tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return f"{crc:08x}"


def _as_published(state: dict[str, torch.Tensor], metadata: dict[str, str], where: str) -> dict[str, torch.Tensor]:
    """``state`` as published, once it matches the checksum its metadata records: a ``PolicyAdapter``
    when its metadata says it is one."""
    from rlhf_pipeline.models.lora import PolicyAdapter, is_adapter_metadata

    recorded = metadata.get(CHECKSUM_KEY)
    if recorded is not None and (found := weights_checksum(state, metadata)) != recorded:
        raise damaged_weights(where, ValueError(f"it fails the crc32c checksum it records ({found}, "
                                                f"recorded {recorded}): bytes of the file changed on disk"))
    return PolicyAdapter.from_metadata(state, metadata) if is_adapter_metadata(metadata) else state


def damaged_weights(where: str, exc: BaseException) -> StateFileError:
    """The refusal of weights that cannot be read (``where``: their path or URL), naming what to do."""
    return damaged("published weights", where, exc, kind="weights this library wrote",
                   remedy="readers take the newest version left, and the learner publishes the next")


def load_weights_file(path: str | Path, where: str | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` from one weight file of either format (a ``PolicyAdapter`` for an
    adapter version); ``where``: what messages call it (default ``path``; a URL's object for a cached copy)."""
    path = Path(path)
    if path.suffix == LEGACY_SUFFIX:
        import torch

        payload = torch.load(path, map_location="cpu", weights_only=True)
        return payload["state_dict"], int(payload["version"])
    from safetensors import safe_open

    # safe_open reads the header, then torch maps each tensor by the path it is given: a learner that
    # prunes or takes back this version in between (a new file may even take its name) would leave a
    # failed or mixed read. Opened once here, the file is read through its descriptor (Linux's
    # /proc/self/fd): this version's bytes, whatever happens to the name
    from safetensors import SafetensorError

    descriptor = os.open(path, os.O_RDONLY)  # FileNotFoundError when pruned already
    try:
        pinned = f"/proc/self/fd/{descriptor}"
        state = {}
        with safe_open(pinned if os.path.exists(pinned) else str(path), framework="pt", device="cpu") as weights:
            named = _NAME.match(path.name)
            metadata = weights.metadata() or {}
            version = int(metadata.get("version") or (named.group(1) if named else -1))
            for name in weights.keys():
                state[name] = weights.get_tensor(name)
    except (SafetensorError, ValueError) as exc:
        raise damaged_weights(where or str(path), exc) from None
    finally:
        os.close(descriptor)
    return _as_published(state, metadata, where or str(path)), version


def _load_object(store: RunStore, name: str) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` of the weight object ``name``; FileNotFoundError when pruned."""
    key = f"{WEIGHTS}/{name}"
    if isinstance(store, LocalRunStore):
        return load_weights_file(store.path(key))
    where = store.describe(key)
    data = store.read(key)
    if data is None:
        raise FileNotFoundError(where)
    named = _NAME.match(name)
    if name.endswith(LEGACY_SUFFIX):
        from rlhf_pipeline.files.state_files import load_state_bytes

        payload = load_state_bytes(data, what="weights file", where=where)
        return payload["state_dict"], int(payload["version"])
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        (header_size,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8:8 + header_size]).get("__metadata__") or {}
        version = int(metadata.get("version") or (named.group(1) if named else -1))
        state = load(data)
    except (SafetensorError, struct.error, ValueError, AttributeError) as exc:  # AttributeError: a header not an object
        raise damaged_weights(where, exc) from None
    return _as_published(state, metadata, where), version


def load_weights(run: Run, version: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``(state_dict, version)`` of ``version`` (default: the newest): whole weights, an adapter
    version merged into its base (version 0); :func:`load_published` gives it as published."""
    from rlhf_pipeline.models.lora import PolicyAdapter, merged_state

    state, version = load_published(run, version)
    if isinstance(state, PolicyAdapter):
        state = merged_state(_base_of(run, state, version), state)
    return state, version


def _base_of(run: Run, adapter, version: int) -> dict[str, torch.Tensor]:
    """Version 0 of ``run``, the base ``adapter`` (of ``version``) was trained on."""
    from rlhf_pipeline.models.lora import state_digest

    try:
        base, _ = load_published(run, 0)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights version {version} is an adapter and its base, version 0, is not under "
                                f"{as_run_store(run).describe(WEIGHTS)}") from None
    if state_digest(base) != adapter.base_digest:
        raise ValueError(f"weights version {version} is an adapter of another base than version 0 of "
                         f"{as_run_store(run).describe(WEIGHTS)}")
    return base


def load_published(run: Run, version: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """``(state, version)`` of ``version`` (default: the newest) as published: whole weights, or a
    ``PolicyAdapter``."""
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
        self._gave_whole_weights = False

    def _listing(self) -> tuple[dict[int, str], dict[str, str]]:
        """Each version's object name, and each object's etag when there is a cache (the same one LIST)."""
        if self.cache is None:
            return _files(self.store), {}
        etags = self.store.list_etags(WEIGHTS)
        return _files(self.store, list(etags)), etags

    def _load(self, name: str, etags: dict[str, str]) -> tuple[dict[str, torch.Tensor], int]:
        if self.cache is None:
            state, version = _load_object(self.store, name)
        else:
            state, version = load_weights_file(self.cache.fetch(self.store, f"{WEIGHTS}/{name}", etags[name]),
                                               where=self.store.describe(f"{WEIGHTS}/{name}"))
        return self._with_base(state, version), version

    def _with_base(self, state, version: int):
        """An adapter handed to an engine that has had no whole weights from this poller gets its base
        attached (a collector started or resumed past version 0)."""
        from rlhf_pipeline.models.lora import PolicyAdapter

        if not isinstance(state, PolicyAdapter):
            self._gave_whole_weights = True
        elif not self._gave_whole_weights:
            state.base = _base_of(self.store, state, version)
            self._gave_whole_weights = True
        return state

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
