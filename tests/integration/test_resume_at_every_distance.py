"""A learner killed at every distance from its last checkpoint resumes to the uninterrupted run,
step for step: the same metrics, the same rows sampled with the same policy versions, the same
weights under the same version numbers. The default pipeline in a run directory and at an ``s3://``
URL (moto); the tool-use pipeline in a run directory (its memmap shards cannot live at a URL).

A killed learner leaves versions published past its checkpoint, metrics lines of the steps it
took since, its pacing intake, and a collector that wrote rows with those versions and stopped
holding one of them. What it leaves is the point here, not the process, so the runs are in this
process: the learner on a thread, the collector (``collect_main``, as ``run`` starts it) on this
one. A kill ends the learner right after a step without the checkpoint a stop would save; its
collector is then stopped as ``run`` stops it when its learner dies (``STOP``: it finishes its
round), and both start again as the same command does. Each run is killed at every distance in
turn, each time resumed from the same checkpoint (step 3, ``learner.checkpoint_every=3``): right
after it (0), then 1 and 2 (``checkpoint_every - 1``) steps past it, every distance a kill can be
from its checkpoint, then it finishes; a resume after a resume is covered on the way. Once more with ``learn`` started again after each
kill beside one ``collect`` that runs on (the long-running commands). The uninterrupted run of
each pipeline is shared (a run at a URL trains as in a directory), and so is each pipeline's
warm start. The real ``kill -9`` of a learner process at a URL: ``tests/integration/test_processes.py``.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.coordination.pacing import read_intake
from rlhf_pipeline.coordination.branch_weights import weights_for_branches
from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.files.object_run_store import ObjectRunStore
from rlhf_pipeline.learn.checkpoint import run_checkpoints
from rlhf_pipeline.learn.learner import Learner
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline, collect_main, with_buffer_url
from rlhf_pipeline.runs.run_directory import prepare_run
from rlhf_pipeline.storage import open_buffer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY = 3
DISTANCES = tuple(range(CHECKPOINT_EVERY))  # steps past the checkpoint at each kill: every distance
STEPS = 2 * CHECKPOINT_EVERY  # one step past the furthest kill
PIPELINES = {
    "default": ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
                "learner.sample_window=32", "learner.new_rows_per_step=16"],
    "tool_use": ["warm_start_steps=20", "tasks_per_round=2", "learner.batch_size=8", "learner.new_rows_per_step=8",
                 "learner.sample_window=16", "log_rounds_every=0"],
}
# a variant of a pipeline: its file, and the settings added to that pipeline's (tests/integration/test_lora_resume.py)
VARIANTS = {"default_lora": ("default", ["learner.lora.rank=4", "learner.lr=3e-3"]),
            "tool_use_lora": ("tool_use", ["learner.lora.rank=4", "learner.lr=3e-3"])}
TIMING = ("time", "tokens_per_s", "_s")  # metrics that measure time, not what was trained
# how full the buffer was when a step drew: a step taken again after a kill finds the rows the
# collector wrote before it (they are kept), so these count more there and nowhere else
BUFFER_FILL = ("charts/buffer_rows", "charts/rows_generated", "charts/rows_generated_per_row_trained")


def pipeline_file(name: str) -> str:
    return str(REPO / "pipelines" / f"{VARIANTS.get(name, (name,))[0]}.py")


def settings_of(name: str, paths: RunPaths) -> list[str]:
    at_url = ["buffer_backend=zarr"] if paths.url is not None else []
    base, added = VARIANTS.get(name, (name, []))
    return [*PIPELINES[base], *added, f"learner.checkpoint_every={CHECKPOINT_EVERY}", f"steps={STEPS}", *at_url]


def start(name: str, paths: RunPaths, *, untils: Sequence[int]) -> None:
    """Learners at ``paths`` one after another (a thread), each training until its step in
    ``untils`` (of ``STEPS``) and ending there without a checkpoint (a kill) unless it finished, and
    one collector beside them all (this thread). One step: a start of ``run``, whose collector is
    stopped with its learner. Several: ``learn`` started again after each kill beside one ``collect``
    that runs on."""
    module = load_pipeline_module(pipeline_file(name))
    pipeline = build_pipeline(module, make_settings(module, settings_of(name, paths)), paths)
    paths = with_buffer_url(paths, pipeline)
    paths.clear_stop()
    ready, stops, failed = threading.Event(), [], []

    def learn() -> None:
        try:
            for until in untils:
                initial_policy = prepare_run(pipeline, paths)  # what each start of a learner does first
                stops.append(threading.Event())
                learner = Learner.from_pipeline(pipeline, paths, stop_event=stops[-1], initial_policy=initial_policy)
                learner.show_progress = False
                try:
                    learner.setup()
                    ready.set()
                    learner.train(max_steps=until - learner.progress.step, checkpoint_when_paused=False)
                finally:
                    learner.cleanup()
                assert learner.progress.step == until
        except BaseException as exc:  # raised in the test's thread below
            failed.append(exc)
        finally:
            ready.set()
            paths.request_stop()  # the learner is gone for good: `run` (or its end) stops the collector

    thread = threading.Thread(target=learn, name="learner")
    thread.start()
    if not paths.store.exists("pacing.json"):  # a first start: `run`'s collector waits for its learner too
        ready.wait()
    try:
        assert collect_main(pipeline, paths) == 0  # returns once the learner is gone (STOP)
    finally:
        for stop in stops:  # the collector failed: a learner waiting for its rows would wait on
            stop.set()
        thread.join()
    if failed:
        raise failed[0]


def trained(run: RunPaths) -> list[dict]:
    store = ObjectRunStore(run.url) if run.url is not None else None
    records = read_metrics("metrics.jsonl" if store is not None else run.metrics, store=store)
    return [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in records]


def rows_of(run: RunPaths) -> dict:
    with open_buffer(run.buffer_location, mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "policy_version", "reward",
                                                             "response_tokens"))
    return {"trajectory_id": rows["trajectory_id"].tolist(), "policy_version": rows["policy_version"].tolist(),
            "reward": rows["reward"].tolist(), "tokens": [t.tolist() for t in rows["response_tokens"].to_list()]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """``prepared(name, where)``: a run directory of pipeline ``name`` at ``where`` as its first start
    prepares it (settings, buffer, the warm-started initial policy as weights version 0), copied from
    one made once per pipeline: the runs compared start from the same weights, warm-started once."""
    made: dict[str, Path] = {}

    def prepare(name: str, where: Path) -> RunPaths:
        if name not in made:
            made[name] = tmp_path_factory.mktemp("prepared") / name
            module = load_pipeline_module(pipeline_file(name))
            paths = RunPaths(made[name])
            prepare_run(build_pipeline(module, make_settings(module, settings_of(name, paths)), paths), paths)
        shutil.copytree(made[name], where)
        return RunPaths(where)

    return prepare


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prepared):
    """Each pipeline's run without a kill, in a directory (made when a test first asks for it)."""
    made: dict[str, RunPaths] = {}

    def run(name: str) -> RunPaths:
        if name not in made:
            made[name] = prepared(name, tmp_path_factory.mktemp("uninterrupted") / name)
            start(name, made[name], untils=[STEPS])
        return made[name]

    return run


def run_at(run_home: str, name: str, prepared) -> RunPaths:
    if "://" not in run_home:
        return prepared(name, Path(run_home) / name)
    return RunPaths.at_url(f"{run_home}/{name}")


# tool_use.py makes memmap shards, which a run at a URL refuses (test_processes.py): at a URL the
# default pipeline only. "run": the same command run again after each kill (its collector stopped
# and started with its learner); "learn": `learn` started again beside one `collect` that runs on
@pytest.mark.parametrize(("name", "run_home", "command"), [
    ("default", "local", "run"), ("default", "s3", "run"), ("tool_use", "local", "run"),
    ("default", "local", "learn"),
], indirect=["run_home"])
def test_a_learner_killed_at_every_distance_from_its_checkpoint_resumes_as_if_never_killed(
        name, run_home, command, prepared, uninterrupted):
    killed = run_at(run_home, name, prepared)
    untils = [CHECKPOINT_EVERY + distance for distance in DISTANCES] + [STEPS]
    if command == "learn":
        start(name, killed, untils=untils)
    else:
        for until in untils[:-1]:
            start(name, killed, untils=[until])
            assert max(published_versions(killed.store)) == until  # the kill's distance from the checkpoint
        start(name, killed, untils=untils[-1:])
    plain = uninterrupted(name)

    resumed, expected = trained(killed), trained(plain)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # every step once, in order
    refilled = range(CHECKPOINT_EVERY + 1, CHECKPOINT_EVERY + max(DISTANCES) + 2)  # steps taken again
    for step, (a, b) in enumerate(zip(resumed, expected, strict=True), start=1):
        # an agent round's groups are appended as they end, so how much of the round in flight is in
        # the buffer when the learner logs a step follows the timing in any two runs; what is trained
        # is compared by every other figure, and the rows below
        if step in refilled or name == "tool_use":
            a, b = ({k: v for k, v in r.items() if k not in BUFFER_FILL} for r in (a, b))
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"

    a, b = rows_of(killed), rows_of(plain)
    ids = a["trajectory_id"]
    starts = [ids[i] for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    assert starts == list(range(len(starts)))  # every round once, in order: none lost, none twice
    if name == "tool_use":
        assert len(starts) < len(ids)  # trajectories of several turns among them
    shared = min(len(a["tokens"]), len(b["tokens"]))
    where, store = plain.state_object(plain.pacing)
    assert shared >= sum(read_intake(where, store=store).consumed.values())  # every row the learner took in
    assert {k: v[:shared] for k, v in a.items()} == {k: v[:shared] for k, v in b.items()}

    assert published_versions(killed.store)[-1] == published_versions(plain.store)[-1] == STEPS
    # what a branch from each kept step samples with is kept through the kill and the resume
    checkpoints = run_checkpoints(killed)
    records = [checkpoints.record(step) for step in checkpoints.steps()]
    assert records and all("held_versions" in record for record in records)
    assert weights_for_branches(records, {}, STEPS) <= set(published_versions(killed.store))
    for version in set(published_versions(killed.store)) & set(published_versions(plain.store)):
        got, want = load_weights(killed.store, version)[0], load_weights(plain.store, version)[0]
        assert all(torch.equal(got[k], want[k]) for k in want), version
