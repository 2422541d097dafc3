"""``run --ray`` on a Ray cluster of several nodes on this one machine, with no path shared between
the nodes and the whole run at a URL (moto's S3 server on loopback).

Each node is its own ``ray start`` with its own temp dir, working directory, cache
(``XDG_CACHE_HOME``) and ``TMPDIR``, as a rented machine would have its own disk; the head holds no
CPUs, so the learner and the collector land on worker nodes. In one run, the collector's node is
killed with every process it runs (SIGKILL to each) and a fresh node joins: Ray restarts the
collector on a live node and it resumes from the shard's state at the URL. Then the learner's
node is killed: the learner restarts on the node with a CPU free, with an empty cache, and
resumes from the newest checkpoint at the URL. The run ends as an uninterrupted one does: the
same metrics step by step, buffer rows and final weights. One run for both losses: each node
start and each plain run costs CI time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from integration.run_location import logged, trained
from integration.test_processes import LABELS, command_at, rows_of

from rlhf_pipeline.coordination.pacing import read_intake
from rlhf_pipeline.coordination.weights import load_weights
from rlhf_pipeline.files.object_run_store import ObjectRunStore

pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")

WORKER_NODES = 3  # the learner's, the collector's and a spare; a fourth joins when the first is lost
STEPS = 10
# a lost node is declared dead after 5 failed health checks, 1 s apart (Ray's default: 3 s apart);
# read by the head's GCS. Each check still waits its default 10 s for an answer: a node merely
# slow on a busy machine is not declared dead
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray(*args: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


class LocalNodes:
    """Ray nodes started here, each ``ray start --block`` in a session of its own, so that stopping
    one is a SIGKILL to its processes and to nobody else's Ray."""

    def __init__(self, base_env: dict[str, str]) -> None:
        # Ray's socket paths must stay short: the scratch lives directly under /tmp
        self.root = Path(tempfile.mkdtemp(prefix="rn"))
        self.base_env = base_env
        self.nodes: dict[str, subprocess.Popen] = {}
        self.cpus: dict[str, int] = {}
        self.address = ""

    def scratch(self, name: str) -> Path:
        return self.root / name

    def env(self, name: str) -> dict[str, str]:
        scratch = self.scratch(name)
        return {**self.base_env, "XDG_CACHE_HOME": str(scratch / "cache"), "TMPDIR": str(scratch / "tmp"),
                "RAY_DEDUP_LOGS": "0", **HEALTH_CHECKS,
                # a cluster on loopback for one test: no token (Ray would take ~/.ray's, a user's own)
                "RAY_AUTH_MODE": "disabled"}

    def start(self, name: str, cpus: int) -> None:
        scratch = self.scratch(name)
        shutil.rmtree(scratch, ignore_errors=True)  # a start tried again begins on a clean disk
        for sub in ("cache", "tmp", "ray"):
            (scratch / sub).mkdir(parents=True)
        ports = ["--node-manager-port", str(_free_port()), "--object-manager-port", str(_free_port()),
                 "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
                 "--runtime-env-agent-port", str(_free_port()), "--min-worker-port", "0", "--max-worker-port", "0"]
        if name == "head":  # (again, after a failed start: a new GCS, a new address)
            gcs = _free_port()
            self.address = f"127.0.0.1:{gcs}"
            role = ["--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--include-dashboard=false",
                    "--ray-client-server-port", str(_free_port())]
        else:
            role = ["--address", self.address, "--node-ip-address", "127.0.0.1"]
        resources = f'{{"{name}": 1}}'
        self.cpus[name] = cpus
        with open(scratch / "ray-start.log", "w") as log:
            self.nodes[name] = subprocess.Popen(
                _ray("start", "--block", *role, *ports, "--num-cpus", str(cpus), "--resources", resources,
                     "--temp-dir", str(scratch / "ray")),
                cwd=scratch, env=self.env(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def join(self, name: str, cpus: int) -> None:
        """Start a node and wait until the cluster lists it."""
        self.start(name, cpus)
        self.wait_for([name])

    def wait_for(self, names: list[str], timeout: float = 120, starts: int = 3) -> None:
        """Wait until the cluster lists every node of ``names``. A node whose ``ray start`` exits before
        it is listed is started again, up to ``starts`` times in all: Ray gives a raylet 30 s to
        register with the GCS, which a loaded CI machine can exceed (the node then exits with 1), and
        a port chosen free can be taken before the raylet binds it. What this file tests begins once
        the nodes are up."""
        tries = dict.fromkeys(names, 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = subprocess.run(_ray("status", "--address", self.address), check=False, capture_output=True, text=True,
                                    env=self.env("head"))
            if all(f" {name}" in status.stdout for name in names):
                return
            for name in names:
                if self.nodes[name].poll() is None:
                    continue
                assert tries[name] < starts, (f"{name} exited {starts} times before it joined", self._logs())
                print(f"[multinode] {name} exited with {self.nodes[name].returncode} before it joined; "
                      f"starting it again:\n{self._logs([name])}")
                self.kill(name)
                tries[name] += 1
                self.start(name, self.cpus[name])
                deadline = max(deadline, time.monotonic() + timeout / 2)
            time.sleep(1)
        raise AssertionError(f"nodes {names} did not join: {self._logs()}")

    def _logs(self, names: list[str] | None = None) -> str:
        """The tail of each node's ``ray start`` output and of its raylet's log: why a node did not
        come up is in the latter."""
        tails = []
        for name in names or list(self.nodes):
            tails.append(f"{name}: {(self.scratch(name) / 'ray-start.log').read_text()[-1500:]}")
            for raylet_log in sorted(self.scratch(name).glob("ray/session_*/logs/raylet.out"))[-1:]:
                tails.append(f"{name} raylet: {raylet_log.read_text(errors='replace')[-1500:]}")
        return "\n".join(tails)

    def processes(self, name: str) -> list[int]:
        """Every process of this node: started in its session, or carrying its scratch in the
        environment (Ray's workers)."""
        marker = f"XDG_CACHE_HOME={self.scratch(name) / 'cache'}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                pid = int(entry.name)
                if os.getsid(pid) == self.nodes[name].pid or marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except (OSError, ProcessLookupError):
                continue
        return found

    def kill(self, name: str) -> None:
        for pid in self.processes(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes[name].wait(timeout=30)

    def stop_all(self) -> None:
        for name in reversed(list(self.nodes)):
            self.kill(name)
        shutil.rmtree(self.root, ignore_errors=True)


def actor_processes(title: str) -> dict[int, str]:
    """pid → the cache directory of every live process whose title starts with ``ray::<title>``. A
    process being torn down after SIGKILL may still show its title with its environment already
    gone: it is left out, as are its zombie and anything else without a cache directory."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(f"ray::{title}".encode()):
                env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
                if env.get(b"XDG_CACHE_HOME"):
                    found[int(entry.name)] = env[b"XDG_CACHE_HOME"].decode()
        except OSError:
            continue
    return found


def moved(title: str, lost_cache: str) -> set[str]:
    """The cache directories of ``title``'s processes, leaving out the lost node's: a process sent
    SIGKILL can still be listed, with its environment, while the kernel tears it down."""
    return {cache for cache in actor_processes(title).values() if cache != lost_cache}


def _wait_until(condition, run: subprocess.Popen, timeout: float):
    """``condition()`` once truthy; None when the run ended first or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.poll() is None:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    return None


def learner_step(run_url: str) -> int:
    """The step of the newest batch the learner took in (``pacing.json``, written as it takes each one).
    The metrics log at a URL is uploaded every few seconds and at checkpoints: by the time it showed a
    step, the learner had once trained to the last step, and the loss of its node came too late."""
    intake = read_intake("pacing.json", store=ObjectRunStore(run_url))
    return 0 if intake is None else intake.step


def newest_weights(run_url: str) -> dict:
    return load_weights(ObjectRunStore(run_url))[0]


@pytest.mark.slow
def test_nodes_lost_with_the_collector_then_the_learner_resume_elsewhere_and_the_run_ends_as_uninterrupted(
        s3_server, tmp_path, monkeypatch):
    for key, value in s3_server.env().items():
        if key.startswith("AWS_"):  # this process reads the results at the URL
            monkeypatch.setenv(key, value)
    home = s3_server.url("runs")
    run_url = f"{home}/multinode"
    nodes = LocalNodes(s3_server.env())
    try:
        nodes.join("head", cpus=0)
        names = [f"node_{k}" for k in range(1, WORKER_NODES + 1)]
        for name in names:  # one at a time: each raylet registers with the GCS while the others are idle
            nodes.join(name, cpus=1)
        on_node = {str(nodes.scratch(n) / "cache"): n for n in [*names, "node_new"]}

        # the driver's machine: its own scratch, too
        driver = nodes.scratch("head") / "driver"
        driver.mkdir()
        run = subprocess.Popen([*command_at(home, "multinode"), "--ray", nodes.address, "--steps", str(STEPS)],
                               cwd=driver, env=nodes.env("head"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            # the learner's own intake, not the metrics log: uploaded every few seconds, that can show step 2 with
            # the learner near its last step, and the run once ended before the learner's loss below was seen
            _wait_until(lambda: learner_step(run_url) >= 2, run, 240)
            collectors, learners = actor_processes("CollectorActor"), actor_processes("LearnerActor")
            assert len(collectors) == 1 and len(learners) == 1, (collectors, learners, run.poll())
            (collector_cache,), (learner_cache,) = collectors.values(), learners.values()
            # each on a worker node of its own, which it knows by its own cache only
            assert collector_cache in on_node and learner_cache in on_node and collector_cache != learner_cache
            lost, learner_node = on_node[collector_cache], on_node[learner_cache]
            killed_at = learner_step(run_url)
            lost_at = time.monotonic()
            nodes.kill(lost)
            # a machine joins in place of the lost one while Ray notices the loss (the collector
            # may restart on it or on the spare node); later the learner's node is lost too
            nodes.start("node_new", cpus=1)
            collector_moved_to = _wait_until(lambda: moved("CollectorActor", collector_cache), run, 120)
            print(f"[multinode] the collector runs again {time.monotonic() - lost_at:.1f} s after its node was lost")
            # the learner's node goes as soon as the run trained on (rows written ahead, or the moved
            # collector's), told by the learner's own intake: every step after it needs a new round
            _wait_until(lambda: learner_step(run_url) > killed_at, run, 240)
            learner_killed_at = learner_step(run_url)
            lost_at = time.monotonic()
            nodes.kill(learner_node)
            # looked for from the kill on: on a loaded machine the learner restarted, resumed and
            # trained to the end in the ~15 s that `ray status` took to list the new node
            with ThreadPoolExecutor(1) as looking:
                learner_moved = looking.submit(_wait_until, lambda: moved("LearnerActor", learner_cache), run, 120)
                nodes.wait_for(["node_new"])  # where the learner can restart: a node with a whole CPU free
                learner_moved_to = learner_moved.result()
            print(f"[multinode] the learner runs again {time.monotonic() - lost_at:.1f} s after its node was lost")
            _wait_until(lambda: len(logged(run_url)) > learner_killed_at, run, 240)
            print(f"[multinode] and has trained past the step it was lost at {time.monotonic() - lost_at:.1f} s after")
            out, _ = run.communicate(timeout=400)
        finally:
            if run.poll() is None:
                run.kill()
        assert run.returncode == 0, out[-4000:]
        assert learner_killed_at < STEPS, "the run ended before the learner's node was lost"
        live = {*names, "node_new"} - {lost, learner_node}
        assert collector_moved_to is not None and len(collector_moved_to) == 1, (collector_moved_to, out[-3000:])
        collector_node = on_node.get(next(iter(collector_moved_to)))
        assert collector_node in live, (collector_node, out[-3000:])
        assert "took over the writer lock" in out, out[-3000:]
        # the learner needs a whole CPU: only the live node without the collector has one
        (free,) = live - {collector_node}
        assert learner_moved_to == {str(nodes.scratch(free) / "cache")}, (learner_moved_to, out[-3000:])
        assert f"[learner] resuming from {run_url}/checkpoints/step_" in out, out[-3000:]

        # nothing of the run on a disk of the driver's but its cache; the rest is at the URL, and
        # the driver's run lease (not the lost learner's: it holds none) was let go
        assert [p.name for p in driver.iterdir()] == [], list(driver.rglob("*"))
        keys = set(s3_server.keys(run_url))
        assert {f"checkpoints/step_{STEPS:08d}.pt", "pacing.json"} <= keys, sorted(keys)
        assert any(key.startswith("collector/shard-0000.history/row_") for key in keys), sorted(keys)
        assert "run.lock" not in keys

        plain = subprocess.run([*command_at(home, "plain"), "--steps", str(STEPS)], check=False, cwd=tmp_path,
                               env={**s3_server.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")},
                               capture_output=True, text=True, timeout=600)
        assert plain.returncode == 0, plain.stderr[-3000:]

        # `--ray` with no ADDRESS joins the cluster RAY_ADDRESS names, as ray.init() does, and says so. In a
        # process of its own: Ray keeps a process's settings (its auth mode) for the clusters it starts later
        joining = subprocess.run(
            [sys.executable, "-c", "from rlhf_pipeline.cluster.driver import _connect\n"
                                   "ray, connected = _connect('')\n"
                                   "print(connected, ray.get_runtime_context().gcs_address)"],
            check=False, cwd=tmp_path, env={**nodes.env("head"), "RAY_ADDRESS": nodes.address},
            capture_output=True, text=True, timeout=120)
        assert joining.returncode == 0, joining.stderr[-3000:]
        connected, joined = joining.stdout.split()[-2:]
        assert connected == "True" and joined.rpartition(":")[2] == nodes.address.rpartition(":")[2], joining.stdout
        assert f"[run] joining the Ray cluster at {nodes.address} (RAY_ADDRESS)" in joining.stderr.splitlines(), \
            joining.stderr[-3000:]
    finally:
        nodes.stop_all()
    resumed, uninterrupted = trained(logged(run_url), LABELS), trained(logged(f"{home}/plain"), LABELS)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # every step once, in order
    for step, (a, b) in enumerate(zip(resumed, uninterrupted, strict=True), start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"
    a, b = rows_of(f"{run_url}/buffer"), rows_of(f"{home}/plain/buffer")
    trained_rows = STEPS * 16
    assert {k: v[:trained_rows] for k, v in a.items() if k != "versions"} == \
        {k: v[:trained_rows] for k, v in b.items() if k != "versions"}
    final, reference = newest_weights(run_url), newest_weights(f"{home}/plain")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference), "the final weights differ"
