"""``run --ray`` / ``learn --ray``: collectors and learner ranks as Ray actors on a local 2-CPU cluster.

One cluster serves the module. Drivers run in this process (they find it connected) except the
SIGINT test, whose driver is a subprocess that joins the cluster by its address.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import preloaded

from rlhf_pipeline.learn.checkpoint import CheckpointManager
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.cluster.driver import ray_launcher
from rlhf_pipeline.runs.run import run_command
from rlhf_pipeline.storage import open_buffer, open_store
from rlhf_pipeline.storage.sharded import list_shards
from rlhf_pipeline.coordination.weights import load_weights, publish_weights

ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SMALL = ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
         "learner.sample_window=32", "learner.new_rows_per_step=16", "learner.checkpoint_every=2",
         "learner.log_every=1"]


def wait_for(condition, driver: subprocess.Popen, what: str, timeout: float = 240):
    """Polls ``condition()`` until it returns something truthy; fails, with what the driver printed,
    when the driver ended first or ``timeout`` passed (a bound for a hung run only)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except ray.exceptions.RayActorError:  # the run's control actor: gone once the driver ends
            driver.wait(timeout=60)  # then say how it ended, below
            value = None
        if value:
            return value
        if driver.poll() is not None:
            pytest.fail(f"the driver ended (exit code {driver.returncode}) before {what}:\n"
                        f"{driver.communicate()[0][-3000:]}")
        time.sleep(0.1)
    driver.kill()  # what it printed says where it was
    pytest.fail(f"timed out waiting for {what}; the driver printed:\n{driver.communicate()[0][-5000:]}")


def control_of(run: Path):
    """The run's control actor, or None before its driver started it."""
    from rlhf_pipeline.cluster.actors import NAMESPACE
    from rlhf_pipeline.cluster.driver import control_actor_name

    try:
        return ray.get_actor(control_actor_name(RunPaths(run)), namespace=NAMESPACE)
    except ValueError:
        return None


def steps_logged(run: Path) -> int:
    return len(read_metrics(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0


def kill_actor_process(control, name: str) -> int:
    """SIGKILL of the process actor ``name`` runs in now (as an OOM killer or a crash would)."""
    pid = ray.get(control.processes.remote())[name][-1]
    os.kill(pid, signal.SIGKILL)
    return pid


def assert_every_id_once_without_gaps(run: Path, group_size: int = 4) -> None:
    """Each shard holds the ids its collector handed out, in order, each once."""
    shards = list_shards(run / "buffer")
    assert shards
    for k, path in shards:
        with open_store(path, mode="r") as shard:
            ids = shard.read(torch.arange(len(shard)), fields=("trajectory_id", "group_id"))
        local = (ids["trajectory_id"] - (k << 40)).tolist()
        assert local == list(range(len(local))), (k, local)
        assert (ids["group_id"] - (k << 40)).tolist() == [i // group_size for i in range(len(local))], k


def test_a_run_on_ray_survives_killed_actors_stops_on_sigint_and_resumes(ray_cluster, tmp_path):
    """A driver (a subprocess joining the cluster) runs 2 collector actors and a learner actor.
    Collector 1's process and then the learner's are killed: Ray restarts both and they resume
    (shard position, checkpoint). Then SIGINT to the driver stops every actor cleanly, and the same
    command resumes to a run whose metrics and shards look like an uninterrupted one's."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--ray", ray_cluster, "--collectors",
               "2", "--home", str(tmp_path), "--run-name", "run", *[a for s in SMALL for a in ("--set", s)]]
    # far more steps than it gets to: SIGINT ends it. A learner as fast as on an idle machine trained
    # 60 steps before the kill below landed, and the run ended before Ray could restart anything
    driver = preloaded.Popen([*command, "--steps", "1000"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        control = wait_for(lambda: control_of(run), driver, "the control actor started")
        wait_for(lambda: CheckpointManager(run / "checkpoints").latest_step(), driver, "a checkpoint")
        # on a loaded machine collector 0's rows alone made the first checkpoint, before collector 1's
        # actor had started: it is killed once it runs
        wait_for(lambda: {"collector 0", "collector 1", "learner"} <= set(ray.get(control.processes.remote())),
                 driver, "every actor started")
        # both at once: their restarts (a new process each, importing torch) overlap
        kill_actor_process(control, "collector 1")
        kill_actor_process(control, "learner")

        def restarted() -> bool:
            started = ray.get(control.processes.remote())
            return len(started["collector 1"]) == 2 and len(started["learner"]) == 2

        wait_for(restarted, driver, "Ray restarted both actors")
        after_kill = steps_logged(run)  # the killed learner is long gone: its successor registered
        wait_for(lambda: (CheckpointManager(run / "checkpoints").latest_step() or 0) > after_kill, driver,
                 "a checkpoint of the restarted learner")
        processes = ray.get(control.processes.remote())
        served = ray.get(control.served.remote())
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=180)
    finally:
        if driver.poll() is None:
            driver.kill()
    # Ray restarted both killed actors in new processes, and the learner resumed from its checkpoint
    assert len(processes["collector 1"]) == 2 and len(processes["learner"]) == 2, processes
    assert len(processes["collector 0"]) == 1
    assert "resuming from" in out, out[-3000:]
    assert served >= 2  # collectors took their weights from the object store
    # SIGINT: every actor stopped cleanly, the learner at a checkpoint
    assert driver.returncode == 130, out[-3000:]
    assert "[run] interrupted (SIGINT)" in out and "[learner] stopped at step" in out, out[-3000:]
    assert "[collector 0] stopped after" in out and "[collector 1] stopped after" in out, out[-3000:]
    stopped_at = CheckpointManager(run / "checkpoints").latest_step()
    assert stopped_at == read_metrics(run / "metrics.jsonl")[-1]["step"]

    resumed = preloaded.run([*command, "--steps", str(stopped_at + 1)], cwd=REPO, capture_output=True,
                            text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {stopped_at})" in resumed.stderr and "[run] done" in resumed.stderr
    # like a normal run's: every step once, in order (the restarted learner truncated the metrics to its
    # checkpoint), the last checkpoint at the last step
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, stopped_at + 2))
    assert {"losses/loss", "charts/reward_mean", "charts/policy_version"} <= set(records[-1])
    assert CheckpointManager(run / "checkpoints").latest_step() == stopped_at + 1
    # no round lost or written twice by the killed collector; collectors loaded published versions
    assert_every_id_once_without_gaps(run)
    with open_buffer(run / "buffer", mode="r") as union:
        versions = union.read(torch.arange(len(union)), fields=("policy_version",))["policy_version"]
    assert int(versions.max()) >= 2


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A run directory whose buffer a collector recorded alone: 3 rounds of 16 rows, policy version 0."""
    home = tmp_path_factory.mktemp("recorded")
    assert run_command("collect", pipeline_path=DEFAULT, steps=3, home=str(home), run_name="recorded",
                       overrides=RECORD) == 0
    return home / "recorded"


RECORD = [*SMALL, "max_lag=none"]  # alone, the collector has version 0 only
# a replay of the recorded rows in order (the same rows for 1 and 2 ranks); the entropy bonus moves the
# weights even where a tiny, barely warm-started policy earns no reward (all advantages 0)
OFFLINE = ["learner.sampler=epoch", "learner.epoch_order=sequential",
           "learner.loss.old_policy=current", "learner.loss.entropy_coef=0.01", "learner.micro_batch_tokens=64", "learner.lr=1e-3",
           "ray.learner_num_cpus=0.5"]


def learn(recorded: Path, tmp_path: Path, name: str, world_size: int, ray_address: str | None,
          parallelism: str = "ddp") -> Path:
    shutil.copytree(recorded, tmp_path / name)
    code = run_command("learn", pipeline_path=DEFAULT, steps=3, home=str(tmp_path), run_name=name,
                       overrides=[*RECORD, *OFFLINE, f"learner.world_size={world_size}",
                                  f"learner.parallelism={parallelism}"],
                       on_ray=None if ray_address is None else ray_launcher("learn", address=ray_address))
    assert code == 0
    return tmp_path / name


@pytest.fixture(scope="module")
def one_learner(recorded, tmp_path_factory) -> Path:
    """The plain learner over the recorded buffer, in this process: what learner actors must match."""
    return learn(recorded, tmp_path_factory.mktemp("one"), "one", 1, ray_address=None)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_learner_actors_train_like_one_learner_on_a_recorded_buffer(ray_cluster, recorded, one_learner, tmp_path,
                                                                        parallelism):
    """Under FSDP, too: what rank 0 hands the object store at each published version is the copy
    gathered to publish it (a gather asked on rank 0 alone would wait for the other rank forever)."""
    one = one_learner
    two = learn(recorded, tmp_path, "two", 2, ray_address="", parallelism=parallelism)
    losses = [[(m["losses/loss"], m["losses/grad_norm"]) for m in read_metrics(root / "metrics.jsonl")]
              for root in (one, two)]
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-6)
    _, reference = CheckpointManager(one / "checkpoints").load()
    _, trained = CheckpointManager(two / "checkpoints").load()
    for key, value in reference["model"].items():
        torch.testing.assert_close(trained["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    initial, _ = load_weights(recorded, 0)
    assert any(not torch.allclose(trained["model"][k], initial[k]) for k in initial)  # it trained


def test_a_collector_on_ray_loads_the_version_pacing_names_not_the_newest(ray_cluster, tmp_path):
    """``poll_version`` as ``weights.WeightsPoller``'s: nothing before the version is published,
    then exactly it (from the object store while it is the newest, else from its file), the newest
    once it was pruned; so rounds on Ray take the weights they take under ``run``, whatever the timing."""
    from rlhf_pipeline.cluster.actors import NAMESPACE, ObjectStoreWeightsPoller, RunControl

    control = RunControl.options(namespace=NAMESPACE).remote()
    state = {v: {"w": torch.full((2,), float(v))} for v in range(7)}

    def publish(version: int) -> None:  # as the learner does: the file, then the object store
        publish_weights(tmp_path, state[version], version)
        ray.get(control.publish_weights.remote(version, [ray.put(state[version])]))

    for version in range(2):
        publish(version)
    poller = ObjectStoreWeightsPoller(tmp_path, control, current_version=0)
    assert poller.poll_version(2) is None  # not published yet
    loaded, version = poller.poll_version(1)
    assert version == 1 and torch.equal(loaded["w"], state[1]["w"])
    assert poller.poll_version(1) is None  # held already
    publish(2), publish(3)
    loaded, version = poller.poll_version(2)  # not the newest (3): from its file
    assert version == 2 and torch.equal(loaded["w"], state[2]["w"])
    for version in range(4, 7):
        publish(version)  # keeps the last 3 files: 4, 5, 6
    loaded, version = ObjectStoreWeightsPoller(tmp_path, control).poll_version(3)  # pruned: the newest
    assert version == 6 and torch.equal(loaded["w"], state[6]["w"])
    ray.kill(control)


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_run_at_a_url_on_ray_keeps_its_state_there(run_home, tmp_path):
    """``--ray`` (a local Ray cluster the driver starts, in the environment that holds the cloud's
    variables): the actors open the run by its URL."""
    from integration.run_location import logged

    from rlhf_pipeline.runs.lineage import run_store_at

    done = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--ray", "--home",
                           run_home, "--run-name", "on-ray", "--steps", "3", "--set", "buffer_backend=zarr",
                           *[a for s in SMALL for a in ("--set", s)]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"[run] run directory {run_home}/on-ray on Ray" in done.stdout + done.stderr, done.stderr[-3000:]
    assert [r["step"] for r in logged(f"{run_home}/on-ray")] == [1, 2, 3]
    keys = set(run_store_at(f"{run_home}/on-ray").walk())
    assert {"checkpoints/step_00000003.pt", "pacing.json"} <= keys, sorted(keys)
    assert any(key.startswith("collector/shard-0000.history/row_") for key in keys), sorted(keys)
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_the_evaluator_runs_as_an_actor_beside_the_collectors_and_resumes_after_kill_9(ray_cluster, tmp_path):
    """With eval.every_steps, the driver starts an evaluator actor; its process killed mid-version,
    Ray restarts it and it resumes from its stores' writer state: every (version, prompt, sample)
    stored once, the run never stopped."""
    from rlhf_pipeline.evaluation.evaluator import ID_STRIDE, EvalProgress, set_store_location

    run = tmp_path / "run"
    location = set_store_location(run, "held_out-k4-t1")  # 40 prompts x 4 samples = 160 rows a version
    evaluation = ["eval.every_steps=2", "eval.samples=4", "eval.temperature=1.0"]
    driver = preloaded.Popen([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--ray", ray_cluster,
                               "--home", str(tmp_path), "--run-name", "run", "--steps", "6",
                               *[a for s in [*SMALL, *evaluation] for a in ("--set", s)]],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def mid_first_version() -> bool:
        if not (location / "manifest.json").exists():
            return False
        try:
            with open_store(location, mode="r") as store:
                return 0 < len(store) < 160
        except (OSError, ValueError):  # made but not published yet
            return False

    try:
        control = wait_for(lambda: control_of(run), driver, "the control actor started")
        wait_for(mid_first_version, driver, "the evaluator stored part of version 0")
        kill_actor_process(control, "evaluator")
        wait_for(lambda: len(ray.get(control.processes.remote())["evaluator"]) == 2, driver,
                 "Ray restarted the evaluator")
        out, _ = driver.communicate(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out[-3000:]
    assert "[run] done" in out and "[eval] step 6 (policy version 6)" in out, out[-3000:]
    with open_store(location, mode="r") as store:
        rows, progress = store.read(torch.arange(len(store))), EvalProgress.of(store)
    assert sorted(progress.done) == [0, 2, 4, 6]
    samples = list(zip(rows["policy_version"].tolist(), rows["trajectory_id"].tolist()))
    assert len(samples) == len(set(samples)) == 4 * 160  # each once, none missing
    for version in (0, 2, 4, 6):
        first = version * ID_STRIDE * 4
        assert sorted(t for v, t in samples if v == version) == list(range(first, first + 160))


@pytest.mark.parametrize("collectors", [2, 3])
def test_actors_a_joined_cluster_has_no_room_for_wait_without_holding_up_training_or_the_end(ray_cluster, tmp_path,
                                                                                            collectors):
    """The learner (1 CPU) and 2 collectors (0.5 each) fill the module's 2-CPU cluster. The evaluator was
    made with them: it waited without a word for room that never came, and the driver then waited 600 s
    for it after the last step (or it took a collector's place, which then waited instead). With 3
    collectors, made before the learner, they could take its place: the driver waited for ever. Now the
    driver says what does not fit, places the learner first where the collectors do not all fit, makes
    the evaluator once training runs, and ends with the learner, waiting for no actor that never started."""
    driver = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--ray", ray_cluster,
                            "--home", str(tmp_path), "--run-name", "run", "--steps", "2",
                            "--collectors", str(collectors),
                            *[a for s in [*SMALL, "eval.every_steps=2"] for a in ("--set", s)]],
                           cwd=REPO, capture_output=True, text=True, timeout=400)  # a bound for a hung run only
    out = driver.stdout + driver.stderr
    assert driver.returncode == 0, out[-3000:]
    assert (f"[run] the run's actors ask Ray for {1 + 0.5 * (collectors + 1):g} CPUs (the learner 1, {collectors} "
            f"collectors 0.5 each, the evaluator 0.5) and the cluster has 2: those that do not fit wait until a node "
            f"with room joins (the evaluator first)") in out, out[-3000:]
    assert "[run] the evaluator never started: the Ray cluster had no room for it" in out, out[-3000:]
    assert "[run] done: 2 learner steps" in out and "[eval]" not in out, out[-3000:]
    assert "did not stop within" not in out, out[-3000:]  # no actor waited for until killed
    never = [line for line in out.splitlines() if line.startswith("[run] collector")]
    if collectors == 2:  # both had their place
        assert never == [], out[-3000:]
    else:  # one of the three waited for room, and was said to
        assert len(never) == 1 and never[0].endswith(" never started: the Ray cluster had no room (see above)"), \
            out[-3000:]


def test_a_learner_the_local_cluster_a_run_starts_has_no_room_for_is_refused_in_one_line(tmp_path):
    """``--ray`` with no cluster to join starts one of this machine's CPUs, which no node joins: a learner
    asking for more waited there for ever, without a word (the driver's rendezvous with it)."""
    more = os.cpu_count() + 1
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--ray",
                            "--home", str(tmp_path), "--run-name", "run", "--steps", "2",
                            *[a for s in [*SMALL, f"ray.learner_num_cpus={more}"] for a in ("--set", s)]],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env=env)  # a bound for a hang only
    assert driver.returncode == 2, driver.stderr[-3000:]
    assert "Traceback" not in driver.stderr, driver.stderr[-3000:]
    error = driver.stderr.strip().splitlines()[-1]  # the cluster's CPUs: this machine's, as Ray counts them
    assert error.startswith(f"rlhf-pipeline run: error: the run's actors ask Ray for {more + 0.5:g} CPUs (the learner "
                            f"{more}, 1 collector 0.5), and the local Ray cluster this run started has "), error
    assert error.endswith(": give each less (--set ray.collector_num_cpus=... / ray.learner_num_cpus=...), start "
                          "fewer collectors, or start a cluster with more (`ray start --head --num-cpus N`, which "
                          "--ray then joins)"), error
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_one_sigterm_to_a_run_on_ray_whose_collector_is_stuck_in_a_round_ends_it(ray_cluster, tmp_path,
                                                                                   monkeypatch, capsys):
    """One SIGTERM with the collector actor stuck in a round (a reward that never returns): the driver
    waited for it for ever, since only a second signal killed the actors. It now waits for the learner
    (it checkpoints), gives the collector its allowance (shortened here from 120 s: the driver runs in
    this process), kills it and ends as interrupted, as ``run`` without Ray does."""
    import threading

    from integration.test_launcher_signals import STUCK_AFTER_ONE_STEP, stuck_in_round_2

    from rlhf_pipeline.runs import stopping

    monkeypatch.setattr(stopping, "COLLECTOR_FINISH_S", 2.0)
    run = tmp_path / "r"

    def sigterm_after_the_first_step() -> None:
        deadline = time.monotonic() + 300
        while not (steps_logged(run) >= 1 and (tmp_path / "stuck").exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # the driver's LauncherSignals take it

    threading.Thread(target=sigterm_after_the_first_step, daemon=True).start()
    code = run_command("run", pipeline_path=stuck_in_round_2(tmp_path), steps=3, home=str(tmp_path), run_name="r",
                       overrides=STUCK_AFTER_ONE_STEP, on_ray=ray_launcher("run", address=ray_cluster))
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 143, out[-3000:]
    assert "[run] 1 actor(s) did not stop within 2 s; killing them" in out, out[-3000:]
    assert CheckpointManager(run / "checkpoints").latest_step() == 1
