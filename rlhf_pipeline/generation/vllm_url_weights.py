"""The weights a ``VLLMURLEngine`` samples with and how they reach its server: :class:`VersionFiles`
(the one life cycle of a version's files, whole weights' and a LoRA run's adapters' alike: written
where the server reads them, kept while it holds them, removed once superseded), :class:`ServerWeights`
(their file, named by the digest of its bytes, loaded by path or inline; what a restarted server of
ours is given again) and :class:`RoundLease`, the collector's side of a shared server's weights lease
(the server's side: ``vllm_lease.py``; the rules: docs/generation.md, "Several collectors on one
server").
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.generation.engine import EngineFailed, EngineStopped, GenerationEngine
from rlhf_pipeline.generation.vllm_http import JsonClient, ServerError

ROUND_LEASE_S = 60.0
"""A round's lease without renewal: renewed every quarter of it, it runs out only for a collector that
died or stalled mid-round, whose sharers wait this long (a stalled one loses its round, nothing stored)."""
FIRST_PAUSE_S = 0.02
LONGEST_PAUSE_S = 0.5


class ServerMismatch(ValueError):
    """The server at the URL cannot sample for this pipeline as it stands (another model or tokenizer,
    another kind of log-prob, no way to take weights); the message names both sides and the fix."""


class VersionFiles:
    """The files of the versions an engine gives its server (whole weights' safetensors files, a LoRA
    run's adapter directories), with one life cycle: written in ``dir`` under names carrying the engine's
    ``tag`` (engines sharing a directory never touch each other's), ``held`` while the server holds them
    (the newest ``keep``: what a restarted server is given again), removed once superseded or refused,
    and at :meth:`close` (the whole directory when it is a temporary one of its own)."""

    def __init__(self, directory: str | Path | None, *, keep: int, tag: str) -> None:
        self._own_dir = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="rlhf-vllm-url-")) if directory is None else Path(directory)
        self.keep, self.tag = int(keep), tag
        self.held: dict[int, Path] = {}  # version -> its file or directory, oldest first

    def path(self, stem: str, suffix: str = "") -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir / f"{stem}-{self.tag}{suffix}"

    def link(self, source: Path, path: Path) -> Path:
        """``path`` made a hard link to ``source`` (beside it, then renamed), so the bytes outlive the
        publisher's pruning; ``source`` itself where no link can be made (another file system)."""
        partial = path.with_suffix(".partial")
        try:
            partial.unlink(missing_ok=True)
            os.link(source, partial)
        except OSError:
            return source
        return partial.replace(path)

    def hold(self, version: int, path: Path) -> list[int]:
        """``version`` is (being) given to the server from ``path``; returns the held versions now past the
        newest ``keep``, oldest first, whose files are removed (as is one held for ``version`` before)."""
        before, self.held[version] = self.held.pop(version, None), path
        gone = list(self.held)[:max(0, len(self.held) - self.keep)]
        for old in [before, *(self.held.pop(v) for v in gone)]:
            if old is not None:
                self.remove(old)
        return gone

    def remove(self, path: Path) -> None:
        """``path`` removed, if this engine wrote it and holds it no longer."""
        if path.parent != self.dir or self.tag not in path.name or path in self.held.values():
            return
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    @staticmethod
    def inline(path: Path) -> str:
        """``path``'s bytes as an RPC argument for a server that cannot read our disk: a file's in base64,
        a directory's as JSON of ``{file name: base64}``."""
        if path.is_dir():
            return json.dumps({file.name: VersionFiles.inline(file) for file in path.iterdir()})
        return base64.b64encode(path.read_bytes()).decode()

    def close(self) -> None:
        held, self.held = self.held, {}
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._own_dir = False
        for path in held.values():
            self.remove(path)


def unreadable(url: str, path: Path, what: str) -> str:
    """The line for a server that cannot read the file (or directory) of ``what`` at ``path``."""
    return (f"generation.url: the server at {url} cannot read {path}, {what}: a server on another machine needs "
            f"generation.url_weights_dir on a file system both machines see, at the same path, or "
            f"generation.weight_transfer=inline")


class ServerWeights:
    """This engine's whole weights and their way to the server at ``client``'s URL.

    ``weights_dir``: where their files are written (:class:`VersionFiles`, one held at a time; None: a
    temporary directory, removed by :meth:`close`); ``inline``: the file's bytes travel in the request;
    ``lease_s``: a round's lease without renewal; ``shared``: other collectors may use the server (a
    lease per round); False for the collector's own."""

    def __init__(self, client: JsonClient, *, weights_dir: str | Path | None, inline: bool, lease_s: float,
                 version: int, shared: bool = True) -> None:
        self.client = client
        self.inline = bool(inline)
        self.lease_s = float(lease_s)
        self.shared = bool(shared)
        self.files = VersionFiles(weights_dir, keep=1, tag=uuid.uuid4().hex[:12])
        self.path: Path | None = None
        """The file of the weights rounds sample with (during a load, the one being loaded)."""
        self.key, self.version = "", int(version)
        self.loads = 0
        """The server loads this engine did (its own versions, and again after another's went in)."""
        self.waited_s = 0.0
        """Seconds its rounds waited for other collectors' rounds on other weights to end."""

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
            self.files.remove(path)
            if isinstance(exc, LeaseUnsupported):  # an engine's first lease: said as its other checks are
                raise ServerMismatch(f"generation.url: {exc}") from None
            raise
        self.files.hold(version, path)

    def keep(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int) -> Path:
        """``version``'s file in the weights directory: a published safetensors file hard-linked there
        (itself on another file system), a state dict or a legacy ``.pt`` publication written there."""
        path = self.files.path(f"weights-{version:08d}", ".safetensors")
        if isinstance(weights, (str, Path)) and Path(weights).suffix == ".safetensors":
            return self.files.link(Path(weights).resolve(), path)
        if isinstance(weights, (str, Path)):  # a legacy .pt publication: the server loads safetensors
            weights = torch.load(weights, map_location="cpu", weights_only=True)["state_dict"]
        from safetensors.torch import save_file

        partial = path.with_suffix(".partial")
        # own contiguous CPU copies: safetensors refuses tensors that share memory (a tied head)
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}, str(partial))
        partial.replace(path)
        return path

    def hold(self, path: Path, version: int) -> None:
        """The server now holds ``version`` (sent another way: NCCL), kept in ``path`` for a restart;
        the file held before is removed."""
        self.path, self.key, self.version = path, "", int(version)
        self.files.hold(version, path)

    def reload(self) -> None:
        """The held version loaded on the server again (a server that restarted from its model directory,
        or the first load of a version), its prefix cache reset; nothing when none past the model
        directory's is held."""
        if self.path is None:
            return
        self._upload("")
        self.reset_prefix_cache()

    def round_lease(self) -> RoundLease:
        """The server held on these weights for one round."""
        return RoundLease(self.client, self.key, self.version, self.lease_s, load=self._upload,
                          reset=self.reset_prefix_cache)

    def _upload(self, lease: str) -> None:
        url, path, version = self.client.base_url, self.path, self.version
        if self.inline:
            request = {"method": "load_published_weights_inline", "args": [VersionFiles.inline(path), lease]}
        else:
            request = {"method": "load_published_weights", "args": [str(path), lease]}
        try:
            reply = self.client.post("/collective_rpc", request)
        except ServerError as exc:
            if "No such file" not in exc.detail and "FileNotFound" not in exc.detail:
                raise
            raise ServerMismatch(unreadable(url, path, f"the weights of version {version}")) from None
        if not all(isinstance(r, dict) and r.get("tensors") for r in reply.get("results", [])):
            raise EngineFailed(f"the vLLM server at {url} did not load {path}: {reply}")
        self.loads += 1

    def reset_prefix_cache(self) -> None:
        # cached prefixes hold the old weights' keys and values; a reset fails while requests hold
        # blocks (a dead collector's, or another client's outside any lease), so it is asked again
        for attempt in range(self.client.retries.retries + 1):
            if self.client.post("/reset_prefix_cache").get("success"):
                return
            time.sleep(self.client.retries.pause(attempt))
        raise EngineFailed(f"the vLLM server at {self.client.base_url} did not reset its prefix cache after loading "
                           f"version {self.version} (requests of other clients running?): its rows would mix weights")

    def close(self) -> None:
        """Removes the files this engine wrote."""
        self.files.close()
        self.path = None


class LeaseUnsupported(ValueError):
    """The server's worker extension has no lease (a checkout older than this one on its PYTHONPATH)."""


class RoundLease:
    """The server's weights held at ``key`` for one round of this collector (see the module docstring).

    ``load(lease_json)``: uploads this collector's weights, tagged with the lease; ``reset()``: resets
    the server's prefix cache (raises when it cannot). Once its process is stopping
    (:attr:`GenerationEngine.stopping <rlhf_pipeline.generation.engine.GenerationEngine.stopping>`), a
    round still waiting for the server gives its place up and raises :class:`EngineStopped`: other
    collectors' rounds may hold the server for as long as they run, and a process whose launcher died
    must not wait on them, its ticket keeping every later round in line behind it."""

    def __init__(self, client: JsonClient, key: str, version: int, ttl_s: float,
                 load: Callable[[str], None], reset: Callable[[], None]) -> None:
        self.client = client
        self.key, self.version, self.ttl_s = key, int(version), float(ttl_s)
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._load, self._reset = load, reset
        self.epoch: int | None = None
        self.waited_s = 0.0
        """Seconds this round waited for other collectors' rounds on other weights to drain."""
        self.load_s = 0.0
        """Seconds this round spent loading its weights (0 when it joined weights already held)."""
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_until_released, name="vllm-lease", daemon=True)

    def _call(self, op: str, *, retry: bool = True, **arguments: Any) -> dict[str, Any]:
        body = {"method": "published_lease", "args": [json.dumps({"op": op, "holder": self.holder, **arguments})]}
        try:
            reply = self.client.post("/collective_rpc", body, retry=retry)
        except ServerError as exc:
            if "published_lease" in exc.detail or exc.status == 404:
                raise LeaseUnsupported(f"the vLLM server at {self.client.base_url} has no weights lease in its worker "
                                       f"extension ({exc.detail}): put this checkout on the server's PYTHONPATH and "
                                       f"restart it") from None
            raise
        return reply["results"][0]

    # ------------------------------------------------------------------ the round
    def __enter__(self) -> RoundLease:
        started = time.monotonic()
        pause = FIRST_PAUSE_S
        stopping = GenerationEngine.stopping or threading.Event()
        self._renewer.start()  # from the first ask to the release: a large model's upload may outlast ttl_s
        try:
            while True:
                reply = self._call("acquire", key=self.key, version=self.version, ttl_s=self.ttl_s)
                if reply["state"] == "granted":
                    break
                if reply["state"] == "loading":
                    reply = self._load_and_mark_ready()
                    if reply["state"] == "granted":
                        break
                    continue  # it expired meanwhile: ask again, from the back of the line
                if stopping.wait(pause):
                    raise EngineStopped(f"stopped while waiting {time.monotonic() - started:.0f} s for the vLLM "
                                       f"server at {self.client.base_url}, held on other weights by other "
                                       f"collectors' rounds; nothing of the round was sampled")
                pause = min(2 * pause, LONGEST_PAUSE_S)
        except BaseException:
            self.__exit__()
            raise
        self.epoch = int(reply["epoch"])
        self.waited_s = time.monotonic() - started - self.load_s
        return self

    def _load_and_mark_ready(self) -> dict[str, Any]:
        started = time.monotonic()
        self._load(json.dumps({"holder": self.holder, "key": self.key, "version": self.version, "ttl_s": self.ttl_s}))
        self._reset()
        self.load_s += time.monotonic() - started
        return self._call("ready")

    def _renew_until_released(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            # one try: a missed renewal is caught by the epoch check, and the next comes in ttl_s / 4; retried,
            # a dead server's renewal would hold the round's end (which joins this thread) for every retry
            with contextlib.suppress(Exception):
                self._call("renew", retry=False, ttl_s=self.ttl_s)

    def check(self) -> None:
        """Raises :class:`EngineFailed` when weights were loaded since this round was granted: the
        replies come in can no longer be said to be the held version's."""
        reply = self._call("renew", ttl_s=self.ttl_s)
        if int(reply["epoch"]) != self.epoch:
            raise EngineFailed(
                f"the vLLM server at {self.client.base_url} loaded other weights under a round of version "
                f"{self.version} (its lease lapsed: this collector did not renew it within its "
                f"{self.ttl_s:g} s); the round's replies are dropped, nothing of it stored")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._renewer.join()
        # an unanswered release expires on the server after ttl_s; asked again only while the server
        # answers: after a request it left unanswered through every retry, they would be waited over again
        with contextlib.suppress(Exception):
            self._call("release", retry=not self.client.silent)


def weights_digest(path: Path) -> str:
    """The weights' identity on a shared server: the same bytes, the same weights, whatever version
    label they carry (two collectors of one run write a version's weights alike)."""
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except FileNotFoundError:  # a file only the server may see: named by its path, its load says the rest
        return f"path:{path}"
