"""``export-model``: a run's policy of one version as a ``save_pretrained`` directory.

Where versions live. The learner publishes ``weights/policy_XXXXXXXX.safetensors`` (``.pt`` in
older runs) and keeps the last few; each checkpoint ``checkpoints/step_XXXXXXXX.pt`` holds the
model after its step, which is the version published at that step when the step published
(``step % learner.publish_every == 0``, the run's setting). :func:`available_versions` lists
both (a weights file wins).

What is written: the pipeline's ``make_model()`` (the run's architecture, from the run's
``pipeline.py`` and ``settings.json``) with that version's weights, saved by
``save_pretrained`` (config, safetensors weights, generation config) and the pipeline's
tokenizer with its chat template. The config records the attention implementation the run
used, so ``AutoModelForCausalLM.from_pretrained(OUT)`` computes the same logits bit for bit;
the generation config samples at the run's temperature and stops at the tokenizer's EOS.
``rlhf_pipeline_export.json`` says which run, version and file the weights came from. The
directory appears at OUT only when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_pipeline.pipeline import PipelineError, RunPaths

_CHECKPOINT = re.compile(r"^step_(\d{8,})\.pt$")


class VersionNotFoundError(LookupError):
    """The version asked for is not on disk; the message lists the ones that are."""


@dataclass(frozen=True)
class VersionSource:
    version: int
    path: Path
    kind: str  # "weights" or "checkpoint"

    def describe(self) -> str:
        return f"v{self.version} ({self.kind} {self.path.name})"


@dataclass
class ExportedModel:
    out: str
    version: int
    source: str
    model_class: str


def available_versions(run_root: str | Path) -> dict[int, VersionSource]:
    """Policy versions whose weights are on disk: published files, then checkpoints that hold one."""
    from rlhf_pipeline.weights import _versions, weights_path

    paths = RunPaths(Path(run_root))
    found: dict[int, VersionSource] = {}
    publish_every = _publish_every(paths)
    if paths.checkpoints.is_dir():
        for file in sorted(paths.checkpoints.iterdir()):
            if not _CHECKPOINT.match(file.name):
                continue
            # mmap: only the small progress record is read, not the model and optimizer tensors
            progress = torch.load(file, map_location="cpu", weights_only=False, mmap=True)["progress"]
            if publish_every and progress["step"] % publish_every == 0:
                found[int(progress["policy_version"])] = VersionSource(int(progress["policy_version"]), file,
                                                                       "checkpoint")
    for version in _versions(paths.root):
        found[version] = VersionSource(version, weights_path(paths.root, version), "weights")
    return dict(sorted(found.items()))


def _publish_every(paths: RunPaths) -> int | None:
    try:
        settings = json.loads(paths.settings_file.read_text())
        return int(settings["learner"]["publish_every"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # without it a checkpoint cannot be matched to a version


def load_version(run_root: str | Path, version: int | None = None) -> tuple[dict[str, torch.Tensor], VersionSource]:
    """The policy weights of ``version`` (default: the newest on disk)."""
    versions = available_versions(run_root)
    if not versions:
        raise VersionNotFoundError(f"{run_root} holds no policy weights (weights/ and checkpoints/ are empty)")
    if version is None:
        version = max(versions)
    if version not in versions:
        listed = ", ".join(v.describe() for v in versions.values())
        raise VersionNotFoundError(
            f"policy version {version} of {run_root} is no longer on disk (weights/ keeps the last few, "
            f"checkpoints/ the last N); available: {listed}")
    source = versions[version]
    if source.kind == "weights":
        from rlhf_pipeline.weights import load_weights_file

        return load_weights_file(source.path)[0], source
    return torch.load(source.path, map_location="cpu", weights_only=False)["model"], source


def export_model(run_root: str | Path, out: str | Path, *, version: int | None = None,
                 pipeline_path: str | Path | None = None) -> ExportedModel:
    """Writes the run's policy of ``version`` to ``out`` (see the module docstring)."""
    from rlhf_pipeline.dataio.run_pipeline import load_run_pipeline

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose another path or remove it")
    state, source = load_version(run_root, version)
    pipeline = load_run_pipeline(run_root, pipeline_path, device="cpu")
    if pipeline.tokenizer is None:
        raise PipelineError("the run's pipeline sets no `tokenizer`, so the export would lack one; set "
                            "Pipeline(tokenizer=...) in its build()")
    model = pipeline.make_model()
    model.load_state_dict(state)
    model.eval()
    # from_pretrained picks its own default attention unless the config names one, and eager vs
    # sdpa differ in the last bits of the logits
    model.config.attn_implementation = model.config._attn_implementation
    generation = model.generation_config
    tokenizer = pipeline.tokenizer
    generation.do_sample = True
    generation.temperature = float(pipeline.learner.temperature)
    if tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        info = {"run": str(Path(run_root).resolve()), "version": source.version, "from": str(source.path),
                "model_class": type(model).__name__}
        (partial / "rlhf_pipeline_export.json").write_text(json.dumps(info, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.replace(partial, out)
    return ExportedModel(str(out), source.version, str(source.path), type(model).__name__)
