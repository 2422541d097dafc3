"""A LoRA run's adapter versions on a vLLM server, the collector's own (``vllm_engine.py``) or one at a URL
(``vllm_url.py``), through the same client. :class:`AdapterServing` is how the server must be started
(``--enable-lora``, ``--max-lora-rank``, ``--max-loras``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).
Before any row, the run's targets are checked against the layers the server takes adapters for and a
zero adapter must score as the base; then each version is loaded under a name of its own (``v<version>``,
with the engine's tag at a URL), never reloaded in place (vLLM #42125, #33791), the newest ``max_loras``
kept, and checked by the canary through the sampling path before any row of it
(:class:`~rlhf_pipeline.generation.loop.ServedPolicyMismatch` on a difference).
Design: docs/lora.md#on-vllm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_pipeline.generation.engine import EngineFailed
from rlhf_pipeline.generation.loop import MergedPolicy, ServedPolicyMismatch, log_prob_gap
from rlhf_pipeline.generation.sampling import SamplingConfig
from rlhf_pipeline.generation.vllm_http import JsonClient, ServerError
from rlhf_pipeline.generation.vllm_url_weights import ServerMismatch, VersionFiles, unreadable
from rlhf_pipeline.models.lora import (
    CANARY_NEW_TOKENS,
    CANARY_PROMPT_TOKENS,
    CANARY_SEED,
    PolicyAdapter,
    canary_prompts,
    canary_tolerance,
    served_policy_failure,
    zero_adapter,
)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` takes (vllm 0.32, ``config/lora.py``); an adapter of a lower
rank is served under the next one up."""
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
PROBE_NAME = "zero-adapter-check"
CANARY_SAMPLING = SamplingConfig(max_new_tokens=CANARY_NEW_TOKENS, temperature=1.0)
"""A canary's request is a row's at temperature 1: its log-probs are the model's own."""


def served_rank(rank: int) -> int:
    """vLLM's ``--max-lora-rank`` for an adapter of ``rank``; ValueError naming the setting past its largest."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"setting 'learner.lora.rank' is {rank}; vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]} "
                     f"(--max-lora-rank takes {list(VLLM_LORA_RANKS)}): use a rank of at most {VLLM_LORA_RANKS[-1]}, "
                     f"or generation.engine=loop")


@dataclass(frozen=True)
class AdapterServing:
    """What a run's adapters ask of a vLLM server: the run's rank, alpha and targets, and how many
    versions stay loaded (``max_loras``: the staleness bound plus one, so a row sampled by an older
    version still has its adapter; derived once by :meth:`of`)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    max_loras: int

    @classmethod
    def of(cls, lora: Any, max_staleness: int | None) -> AdapterServing:
        """From ``learner.lora`` (a ``LoraSettings``) and the learner's ``max_staleness`` (None, no bound:
        two, the version sampling and the one before)."""
        served_rank(lora.rank)
        return cls(int(lora.rank), float(lora.alpha), tuple(lora.target_modules),
                   (max_staleness if max_staleness is not None else 1) + 1)

    @property
    def max_lora_rank(self) -> int:
        return served_rank(self.rank)

    def server_flags(self) -> list[str]:
        return ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]


class ServedAdapters:
    """The adapter versions loaded on the server at ``client``'s URL, for one engine.

    ``reference``: the engine's model, holding the base the server holds (the learner's forward of each
    version is computed by merging the version into it: ``loop.MergedPolicy``); ``weights``: the engine's
    whole weights (``vllm_url_weights.ServerWeights``: the base; its files' directory and tag are the
    adapters' too, and their life cycle, ``VersionFiles``; on a server other collectors may share, names
    carry the tag and checks hold a round's lease); ``sample(prompt, n, seed, sampling, limit, model)``: that
    request's completions through the engine's rows' path (its checks included)."""

    def __init__(self, client: JsonClient, serving: AdapterServing, reference: torch.nn.Module, weights: Any, *,
                 sample: Callable[..., list[Any]], max_model_len: int, served_model: str) -> None:
        self.client, self.serving, self.weights = client, serving, weights
        scored = "the log-probs of the canary tokens under the base this engine holds with the adapter merged"
        self.reference = MergedPolicy(reference, scored, holds_base=True)
        self.files = VersionFiles(weights.files.dir / "adapters", keep=serving.max_loras, tag=weights.files.tag)
        """The versions' directories; ``held``: version -> directory, oldest first, each loaded on the server."""
        self._sample = sample
        self._suffix = f"-{weights.files.tag}" if weights.shared else ""
        self.served_model = served_model
        self.vocab_size = int(reference.config.vocab_size)
        length = min(CANARY_PROMPT_TOKENS, max(1, max_model_len - CANARY_NEW_TOKENS))
        self.prompts = canary_prompts(self.vocab_size, length)
        self.last_difference: float | None = None
        """The sampling-path canary of the last version loaded: its largest log-prob difference."""
        self.served_layers: list[str] = []
        """The layer names the server takes adapters for (asked by :meth:`check_server`)."""

    def name(self, version: int) -> str:
        """The model a request of ``version`` names: the base for version 0 (or whole weights), else
        the version's adapter."""
        return self.loaded_name(version) if version in self.files.held else self.served_model

    def loaded_name(self, version: int) -> str:
        """The name ``version``'s adapter is loaded under."""
        return f"v{version}{self._suffix}"

    def check_server(self) -> None:
        """Before any row: the run's targets are layers the server takes adapters for, and a zero adapter
        of the run's rank and targets loads and scores as the base; else one line naming the setting."""
        self.served_layers = self._served_layers()
        self._check_targets(list(self.serving.target_modules), None)
        probe = zero_adapter(self.reference.model, self.serving.rank, self.serving.alpha, self.serving.target_modules)
        name, path = PROBE_NAME + self._suffix, self.files.path(PROBE_NAME)
        probe.save_peft_directory(path)
        try:
            with self._held_round():
                self._put(name, path, version=None)
                self._check_sampled(name, None)
        finally:
            self._unload(name)
            self.files.remove(path)

    def load(self, weights: Any, version: int) -> None:
        """``version``'s weights: an adapter loaded by name (:meth:`take`), or whole weights (the base,
        version 0) given to the server as any engine's."""
        adapter = adapter_of(weights)
        if adapter is None:  # the reference holds them too: the base of the adapters that follow
            self.weights.take(weights, version)
            self.reference.load(self.weights.path, version)
            return
        if adapter.base is not None:  # a collector started past version 0: the server's base first
            self.weights.take(adapter.base, 0)
        with self._held_round():
            self.take(adapter, version)

    def _held_round(self) -> Any:
        """A round's lease on a server other collectors may share: its base stays while a check samples."""
        return self.weights.round_lease() if self.weights.shared else contextlib.nullcontext()

    def take(self, adapter: PolicyAdapter, version: int) -> None:
        """``adapter`` loaded under its version's name, checked through the sampling path; older
        versions past ``max_loras`` unloaded. An adapter that brings its base (a collector started past
        version 0) has had it given to the server first; the reference loads it with the adapter."""
        if adapter.config.get("modules_to_save"):
            raise ServedPolicyMismatch(f"weights version {version} cannot be served: its adapter saves whole "
                                       f"modules ({adapter.config['modules_to_save']}), which vLLM serves only for "
                                       f"classifiers; train an adapter without modules_to_save")
        self._check_targets(adapter.layer_names, version)
        path = self.files.path(f"v{version}")
        adapter.save_peft_directory(path)
        for old in self.files.hold(version, path):  # the newest max_loras stay loaded, this one among them
            self._unload(self.loaded_name(old))
        try:
            self._put(self.loaded_name(version), path, version)
            self.reference.load(adapter, version)  # what the server's log-probs are compared with
            self._check_sampled(self.name(version), version)  # the name the version's rows will carry
        except BaseException:
            self._unload(self.loaded_name(version))
            self.files.remove(self.files.held.pop(version))
            raise

    def reload(self, version: int) -> None:
        """After a restart of the server (it came back with the base only): every adapter it held loaded
        again, and the held ``version`` checked again."""
        for held, path in self.files.held.items():
            self._put(self.loaded_name(held), path, held)
        if version in self.files.held:
            self._check_sampled(self.name(version), version)

    def close(self) -> None:
        """This engine's adapter directories removed; on a server other collectors share (one at a URL)
        its adapters are unloaded too, one try each, so they do not outlive it there."""
        for version in self.files.held if self.weights.shared else ():
            with contextlib.suppress(EngineFailed):  # a server gone by now holds nothing of ours
                self._unload(self.loaded_name(version), retry=False)
        self.files.close()

    # ------------------------------------------------------------------ the server's side
    def _served_layers(self) -> list[str]:
        """What the server's adapter loader takes (our worker extension's ``served_published_lora_modules``);
        empty from a server started without ``--enable-lora``, which the zero adapter's load then names."""
        try:
            reply = self.client.post("/collective_rpc", {"method": "served_published_lora_modules"})
        except ServerError as exc:
            raise ServerMismatch(f"generation.url: the vLLM server at {self.client.base_url} cannot say which layers "
                                 f"it takes adapters for (HTTP {exc.status}: {exc.detail}): start it with this "
                                 f"checkout's worker extension (PYTHONPATH=<this checkout>, as docs/lora.md, On vLLM, "
                                 f"says)") from None
        return list(reply["results"][0])

    def _check_targets(self, layers: list[str], version: int | None) -> None:
        """``layers`` (the run's targets, or a version's adapted layers) all taken by the server, else one line
        naming the setting and the layers it serves: before the server is asked to load anything."""
        unserved = [layer for layer in layers if self.served_layers and layer not in self.served_layers]
        if not unserved:
            return
        what = "this run's adapters" if version is None else f"weights version {version}'s adapter"
        refused = ServerMismatch if version is None else ServedPolicyMismatch
        raise refused(f"setting 'learner.lora.target_modules' ({','.join(layers)}): the vLLM server at "
                      f"{self.client.base_url} takes adapters on {','.join(self.served_layers)} of this model, "
                      f"not on {','.join(unserved)}, so it cannot serve {what}; target only layers it serves")

    def _put(self, name: str, path: Path, version: int | None) -> None:
        try:
            if self.weights.inline:  # the server writes the directory where it reads it (vllm_worker.py)
                reply = self.client.post("/collective_rpc", {"method": "save_published_adapter",
                                                             "args": [name, VersionFiles.inline(path)]})
                path = Path(reply["results"][0])
            self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, text=True)
        except ServerError as exc:
            raise self._refusal(exc, version, path) from None

    def _refusal(self, exc: ServerError, version: int | None, path: Path) -> Exception:
        """One line naming the setting; a :class:`ServerMismatch` (refused at connection, before any row)
        for the zero adapter, else the version's :class:`ServedPolicyMismatch`."""
        refused = ServerMismatch if version is None else ServedPolicyMismatch
        detail, flags = exc.detail, " ".join(self.serving.server_flags())
        what = "the run's adapter" if version is None else f"weights version {version}'s adapter"
        if exc.status == 404:
            return refused(
                f"generation.url: the vLLM server at {self.client.base_url} has no /v1/load_lora_adapter: a LoRA run "
                f"(learner.lora.rank={self.serving.rank}) needs a server started with {flags} and "
                f"{RUNTIME_LORA_ENV}=1")
        if "max_lora_rank" in detail or "LoRA is not enabled" in detail or "enable-lora" in detail:
            return refused(
                f"setting 'learner.lora.rank' is {self.serving.rank}, and the vLLM server at {self.client.base_url} "
                f"refuses {what}: {detail}; start it with {flags}, or lower learner.lora.rank")
        if "No such file" in detail or "not found" in detail.lower() or "does not exist" in detail:
            return refused(unreadable(self.client.base_url, path, what))
        return refused(f"{what} cannot be served: the vLLM server at {self.client.base_url} refused it: {detail}")

    def _unload(self, name: str, *, retry: bool = True) -> None:
        """``name`` unloaded from the server (and, sent inline, its directory there removed)."""
        with contextlib.suppress(ServerError):  # never loaded (its load was refused), or gone with a restarted server
            self.client.post("/v1/unload_lora_adapter", {"lora_name": name}, text=True, retry=retry)
        if self.weights.inline:
            with contextlib.suppress(ServerError):
                self.client.post("/collective_rpc", {"method": "remove_published_adapter", "args": [name]},
                                 retry=retry)

    # ------------------------------------------------------------------ the canary
    def _check_sampled(self, name: str, version: int | None) -> None:
        """The canary prompts sampled under ``name`` through the rows' path; the log-probs of the sampled
        tokens must be the reference's (``version`` None: the zero adapter, whose reference is the base)."""
        prompts, completions = [], []
        for index, prompt in enumerate(self.prompts):
            try:
                answered = self._sample(prompt, 2, CANARY_SEED + index, CANARY_SAMPLING, CANARY_NEW_TOKENS, name)
            except ServerError as exc:
                which = "the zero-adapter check" if version is None else f"weights version {version}"
                raise (ServerMismatch if version is None else ServedPolicyMismatch)(
                    f"served-policy check failed for {which}: the vLLM server does not sample "
                    f"under {name!r} (HTTP {exc.status}: {exc.detail}), so no row of it is stored") from None
            prompts += [prompt] * len(answered)
            completions += answered
        difference = log_prob_gap(self.reference.model, prompts, completions, None)
        tolerance = canary_tolerance(next(self.reference.model.parameters()).dtype)
        if not difference <= tolerance:
            if version is None:
                raise ServerMismatch(
                    f"setting 'learner.lora.rank' ({self.serving.rank}): the vLLM server at {self.client.base_url} "
                    f"does not serve a zero adapter as the base (log-probs up to {difference:.4g} apart, tolerance "
                    f"{tolerance:g}): it cannot serve this run's adapters; generate with generation.engine=loop")
            scored = f"the server's log-probs of the canary tokens it sampled under {name!r}"
            raise ServedPolicyMismatch(served_policy_failure(version, difference, tolerance, scored))
        if version is not None:
            self.last_difference = difference


def adapter_of(weights: Any) -> PolicyAdapter | None:
    """``weights`` as an adapter version when it is one (handed over as a ``PolicyAdapter``, or the path
    of a published adapter file), else None."""
    if isinstance(weights, PolicyAdapter):
        return weights
    if isinstance(weights, (str, Path)) and Path(weights).suffix == ".safetensors":
        from safetensors import safe_open

        from rlhf_pipeline.models.lora import is_adapter_metadata

        with safe_open(str(weights), framework="pt") as file:
            metadata = file.metadata()
            if not is_adapter_metadata(metadata):
                return None
            tensors = {key: file.get_tensor(key) for key in file.keys()}
        return PolicyAdapter.from_metadata(tensors, metadata)
    return None

