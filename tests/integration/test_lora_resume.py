"""A LoRA run on the default and the tool-use pipelines (``learner.lora.rank=4``) with the machinery of
tests/integration/test_resume_at_every_distance.py (its runs, kills and comparisons): a learner killed
at a few distances from its checkpoint resumes to the uninterrupted run, step for step (the same
metrics, rows and adapters under the same version numbers); a collector handed a stale adapter stops
with one line naming the version, before any row of it; the rows of the learner's own version
agree with it as a full fine-tuning run's do."""

from __future__ import annotations

import threading

import pytest
from helpers import needs_peft
import torch

from rlhf_pipeline.coordination.weights import WeightsPoller, load_published, published_versions
from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline, collect_main
from tests.integration.test_resume_at_every_distance import (  # noqa: F401  (fixtures)
    BUFFER_FILL,
    CHECKPOINT_EVERY,
    STEPS,
    pipeline_file,
    prepared,
    rows_of,
    settings_of,
    start,
    trained,
    uninterrupted,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              needs_peft]
NAME = "default_lora"


@pytest.mark.parametrize("name", [NAME, "tool_use_lora"])
def test_a_lora_learner_killed_past_its_checkpoint_resumes_as_if_never_killed(name, tmp_path, prepared, uninterrupted):
    """The default pipeline's single-turn rows, and the tool-use pipeline's multi-turn trajectories
    (their agent rounds append groups as they end: how full the buffer was is left out of the compared
    figures there, as the resume test of every distance leaves it)."""
    killed = prepared(name, tmp_path / name)
    distances = (0, 2)
    for until in [CHECKPOINT_EVERY + d for d in distances]:
        start(name, killed, untils=[until])
        assert max(published_versions(killed.store)) == until
    start(name, killed, untils=[STEPS])
    plain = uninterrupted(name)

    resumed, expected = trained(killed), trained(plain)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    refilled = range(CHECKPOINT_EVERY + 1, CHECKPOINT_EVERY + max(distances) + 2)
    for step, (a, b) in enumerate(zip(resumed, expected, strict=True), start=1):
        if step in refilled or name == "tool_use_lora":
            a, b = ({k: v for k, v in r.items() if k not in BUFFER_FILL} for r in (a, b))
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"
    a, b = rows_of(killed), rows_of(plain)
    shared = min(len(a["tokens"]), len(b["tokens"]))
    assert {k: v[:shared] for k, v in a.items()} == {k: v[:shared] for k, v in b.items()}

    assert published_versions(killed.store)[0] == 0  # the base, kept for the whole run
    for version in range(1, STEPS + 1):
        if version not in published_versions(plain.store) or version not in published_versions(killed.store):
            continue
        got, want = load_published(killed.store, version)[0], load_published(plain.store, version)[0]
        assert got.canary == want.canary and all(torch.equal(got[k], want[k]) for k in want), version


class WrongAdapterPoller(WeightsPoller):
    """Hands the collector's engine another kept version's adapter under the number of the first adapter
    it loads, as a stale cached file (or a load skipped) would."""

    refused: int | None = None

    def _load(self, name, etags):
        state, version = super()._load(name, etags)
        if self.refused is not None or state.base is None:
            return state, version
        others = [v for v in published_versions(self.store) if v not in (0, version)]
        wrong, _ = load_published(self.store, others[-1])
        wrong.base, self.refused = state.base, version
        return wrong, version


def test_the_rows_of_the_learners_own_version_agree_with_it_to_the_full_fine_tuning_tolerance(uninterrupted):
    """Recomputed against stored log-probs, per sampling version: on the rows of the version a step
    trains with (publish_every=1: the version before the step's own) the loop engine's merged adapter
    and the learner's peft forward agree as a full fine-tuning run's first step does, and the gap of
    older rows (the policy's drift) stays within a full fine-tuning run's bound
    (tests/integration/test_default_pipeline.py)."""
    records = trained(uninterrupted(NAME))
    own = [r.get("losses/sampler_logprob_diff_max/staleness_0") for r in records]
    gaps = {(r["step"], key.rsplit("/", 1)[1]): value for r in records for key, value in r.items()
            if key.startswith("losses/sampler_logprob_diff_max/staleness_")}
    assert [gap for gap in own if gap is not None] and max(gap for gap in own if gap is not None) < 1e-4, own
    assert len(gaps) >= STEPS and max(gaps.values()) < 0.5, gaps


def test_a_collector_handed_a_wrong_adapter_stops_naming_the_version_before_any_row_of_it(
        tmp_path, prepared, capfd):
    paths = prepared(NAME, tmp_path / NAME)
    start(NAME, paths, untils=[STEPS])  # versions 1..STEPS published, the rows of each written
    rows_before = rows_of(paths)
    module = load_pipeline_module(pipeline_file(NAME))
    pipeline = build_pipeline(module, make_settings(module, settings_of(NAME, paths)), paths)
    paths.clear_stop()
    capfd.readouterr()
    poller = WrongAdapterPoller(paths.store)
    # a collector that took the wrong adapter would wait for the finished learner for ever: stopped
    # by then, it returns 0 and the test fails instead of hanging
    watchdog = threading.Timer(300, paths.request_stop)
    watchdog.start()
    try:
        code = collect_main(pipeline, paths, rounds=1, poller=poller)
    finally:
        watchdog.cancel()
    said = capfd.readouterr().err
    assert code == 1 and poller.refused is not None, said
    assert (f"[collector] stopped: weights version {poller.refused} cannot be served: it holds the adapter the "
            f"learner published as version ") in said, said
    assert rows_of(paths) == rows_before  # nothing written since: no row of the refused version
