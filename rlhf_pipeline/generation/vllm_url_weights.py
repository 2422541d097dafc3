"""The weights a ``VLLMURLEngine`` samples with, on a server it may share with other collectors:
their file, their identity, and how they reach the server (``vllm_url.py`` is the engine).

The file is also what a restarted server is given (a server the collector owns, ``vllm_engine.py``,
that died): it starts from its model directory, and :meth:`ServerWeights.reload` loads the version
the dead one held. A published safetensors file is hard-linked into the weights directory (no copy:
the learner pruning the published version does not lose it); a state dict is written there.

Each version a collector takes is written once as a safetensors file (or a published one is read as it
is) and named by the digest of its bytes: the key of the server's weights lease
(``generation/vllm_lease.py``), so collectors holding the same weights share them on the server and
only a round needing other weights waits for the held ones to drain. The file stays until the next
version replaces it: the server may have to load it again whenever another collector's weights went in
between two rounds of this one (each collector's files carry a tag of its own, so collectors sharing
``generation.url_weights_dir`` never remove each other's).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from rlhf_pipeline.generation.engine import EngineFailed
from rlhf_pipeline.generation.vllm_http import JsonClient, ServerError
from rlhf_pipeline.generation.vllm_url_lease import LeaseUnsupported, RoundLease


class ServerMismatch(ValueError):
    """The server at the URL cannot sample for this pipeline as it stands (another model or tokenizer,
    another kind of log-prob, no way to take weights); the message names both sides and the fix."""


class ServerWeights:
    """This engine's weights and their way to the server at ``client``'s URL.

    ``weights_dir``: where files are written (None: a temporary directory, removed by :meth:`close`);
    ``inline``: the file's bytes travel in the request; ``lease_s``: a round's lease without renewal;
    ``shared``: other collectors may use the server (a lease per round); False for the collector's own."""

    def __init__(self, client: JsonClient, *, weights_dir: str | Path | None, inline: bool, lease_s: float,
                 version: int, shared: bool = True) -> None:
        self.client = client
        self.inline = bool(inline)
        self.lease_s = float(lease_s)
        self.shared = bool(shared)
        self._own_dir = weights_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="rlhf-vllm-url-")) if weights_dir is None else Path(weights_dir)
        self._tag = uuid.uuid4().hex[:12]
        self.path: Path | None = None
        self.key, self.version = "", int(version)
        self.loads = 0
        """The server loads this engine did (its own versions, and again after another's went in)."""
        self.waited_s = 0.0
        """Seconds its rounds waited for other collectors' rounds on other weights to end."""
        self.unkept_version: int | None = None
        """The version the server holds when it was sent without a file (NCCL with no restarts allowed)."""

    def take(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int) -> None:
        """``weights`` become the ones this engine's rounds sample with, loaded on the server now (a
        file it cannot read is said here and changes nothing)."""
        path = self.keep(weights, version)
        before = (self.path, self.key, self.version)
        self.path, self.key, self.version = path, weights_digest(path), int(version)
        try:
            if self.shared:
                with self.round_lease() as lease:  # loads them, unless the server holds them already
                    self.waited_s += lease.waited_s
            else:
                self.reload()
        except BaseException as exc:
            self.path, self.key, self.version = before
            if self._ours(path) and path != before[0]:
                path.unlink(missing_ok=True)
            if isinstance(exc, LeaseUnsupported):  # an engine's first lease: said as its other checks are
                raise ServerMismatch(f"generation.url: {exc}") from None
            raise
        self.unkept_version = None
        if before[0] is not None and before[0] != path and self._ours(before[0]):
            before[0].unlink(missing_ok=True)

    def keep(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int) -> Path:
        """``version``'s file in the weights directory: a published safetensors file hard-linked there
        (itself on another file system), a state dict or a legacy ``.pt`` publication written there."""
        from rlhf_pipeline.generation.vllm_process import hard_link

        if isinstance(weights, (str, Path)) and Path(weights).suffix == ".safetensors":
            self.dir.mkdir(parents=True, exist_ok=True)
            return hard_link(Path(weights).resolve(), self.dir / f"weights-{version:08d}-{self._tag}.safetensors")
        if isinstance(weights, (str, Path)):  # a legacy .pt publication: the server loads safetensors
            weights = torch.load(weights, map_location="cpu", weights_only=True)["state_dict"]
        return self._write(weights, version)

    def hold(self, path: Path, version: int) -> None:
        """The server now holds ``version`` (sent another way: NCCL), kept in ``path`` for a restart;
        the file held before is removed."""
        old, self.path, self.key, self.version, self.unkept_version = self.path, path, "", int(version), None
        if old is not None and old != path and self._ours(old):
            old.unlink(missing_ok=True)

    def held_unkept(self, version: int) -> None:
        """The server now holds ``version``, sent without a file (NCCL with no restarts allowed): a
        restart cannot give it again, so :meth:`reload` refuses, naming the setting."""
        if self.path is not None and self._ours(self.path):
            self.path.unlink(missing_ok=True)
        self.path, self.key, self.version, self.unkept_version = None, "", int(version), int(version)

    def reload(self) -> None:
        """The held version loaded on the server again (a server that restarted from its model directory,
        or the first load of a version), its prefix cache reset; nothing when none past the model
        directory's is held. EngineFailed when the held version was not kept as a file."""
        if self.unkept_version is not None:
            raise EngineFailed(f"the engine died holding version {self.unkept_version}, sent over NCCL and not kept "
                               f"as a file (generation.retries was 0 when it was sent), so a new server cannot be "
                               f"given it: keep generation.retries > 0 from the start, then rerun to resume")
        if self.path is None:
            return
        self._upload("")
        self.reset_prefix_cache()

    def round_lease(self) -> RoundLease:
        """The server held on these weights for one round (``generation/vllm_url_lease.py``)."""
        return RoundLease(self.client, self.key, self.version, self.lease_s, load=self._upload,
                          reset=self.reset_prefix_cache)

    def _ours(self, path: Path) -> bool:
        return path.parent == self.dir and self._tag in path.name

    def _write(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"weights-{version:08d}-{self._tag}.safetensors"
        partial = path.with_suffix(".partial")
        # own contiguous CPU copies: safetensors refuses tensors that share memory (a tied head)
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}, str(partial))
        partial.replace(path)
        return path

    def _upload(self, lease: str) -> None:
        url, path, version = self.client.base_url, self.path, self.version
        if self.inline:
            import base64

            request = {"method": "load_published_weights_inline",
                       "args": [base64.b64encode(path.read_bytes()).decode(), lease]}
        else:
            request = {"method": "load_published_weights", "args": [str(path), lease]}
        try:
            reply = self.client.post("/collective_rpc", request)
        except ServerError as exc:
            if "No such file" not in exc.detail and "FileNotFound" not in exc.detail:
                raise
            raise ServerMismatch(f"generation.url: the server at {url} cannot read {path}, the weights of version "
                                 f"{version}: a server on another machine needs generation.url_weights_dir on a file "
                                 f"system both machines see, at the same path, or generation.weight_transfer=inline") from None
        if not all(isinstance(r, dict) and r.get("tensors") for r in reply.get("results", [])):
            raise EngineFailed(f"the vLLM server at {url} did not load {path}: {reply}")
        self.loads += 1

    def reset_prefix_cache(self) -> None:
        # cached prefixes hold the old weights' keys and values; a reset fails while requests hold
        # blocks (a dead collector's, or another client's outside any lease), so it is asked again
        for attempt in range(self.client.retry.retries + 1):
            if self.client.post("/reset_prefix_cache").get("success"):
                return
            time.sleep(self.client.retry.pause(attempt))
        raise EngineFailed(f"the vLLM server at {self.client.base_url} did not reset its prefix cache after loading "
                           f"version {self.version} (requests of other clients running?): its rows would mix weights")

    def close(self) -> None:
        """Removes the files this engine wrote."""
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._own_dir = False
        elif self.path is not None and self._ours(self.path):
            self.path.unlink(missing_ok=True)
        self.path = None


def weights_digest(path: Path) -> str:
    """The weights' identity on a shared server: the same bytes, the same weights, whatever version
    label they carry (two collectors of one run write a version's weights alike)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 22), b""):
                digest.update(block)
    except FileNotFoundError:  # a file only the server may see: named by its path, its load says the rest
        return f"path:{path}"
    return digest.hexdigest()
