"""Shared pytest setup: ``tests/`` on ``sys.path`` so tests can ``from helpers import ...``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# Two cores shared by many processes, two of them pytest-xdist's workers (pyproject's addopts), each
# importing this file: one intra-op thread each keeps tests predictable and the cores not oversubscribed.
torch.set_num_threads(1)

# Ray starts its workers (our actors) at nice 15 (its `worker_niceness`): beside the other xdist worker's
# vLLM servers and runs at nice 0 they are starved: beside two busy loops, a run on Ray had not reached
# its first checkpoint in 10 minutes, and passed its test in 2 min 21 s at nice 0 (docs/ray.md). Every
# cluster the tests start, in this process or in a subprocess, runs its workers at the usual priority
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(scope="module")
def ray_cluster() -> str:
    """A local Ray cluster of 2 CPUs for the module; its GCS address, for drivers in other processes (a
    driver in this process finds it connected). Per module: test_ray_multinode.py, in the same worker
    (SHARED_FILES), starts nodes of its own, which must not find this one running."""
    import ray

    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a free port) for the session; skips without the s3 extras."""
    from s3_server import S3Server, missing_packages

    missing = missing_packages()
    if missing:
        pytest.skip(f"s3:// tests need {', '.join(missing)}: pip install -e '.[s3,test-s3]'")
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB tmpfs (mounting needs root: skipped without it), unmounted afterwards: a disk that
    fills (with ``fill`` in tests/helpers.py) without filling the machine's."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture()
def s3_env(s3_server, tmp_path, monkeypatch):
    """The S3 server's AWS variables for child processes (returned) and for this process (set); the
    cache of runs at a URL under ``tmp_path``; one OpenMP thread in the children."""
    environment = {**s3_server.env(), "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                "XDG_CACHE_HOME"):
        monkeypatch.setenv(key, environment[key])
    return environment


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """Azurite (the Azure Blob Storage emulator) on 127.0.0.1 for the session; skips, saying what to
    install, without the azure extra or Azurite."""
    from azurite_server import AzuriteServer, missing_requirements

    missing = missing_requirements()
    if missing:
        pytest.skip(f"az:// tests need {'; '.join(missing)}")
    server = AzuriteServer(tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()


@pytest.fixture(params=["s3", "azure"])
def object_server(request):
    """The object store a test's buffer lives on, where only the buffer is remote (the run directory
    stays local): moto's S3 server or Azurite, the same tests on each (each skips, saying what to
    install, without its extra or emulator). ``server.url(name)``, ``.env()``, ``.keys(url)``."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(params=["local", "s3", "azure"])
def run_home(request, tmp_path, monkeypatch) -> str:
    """Where runs live, the one location parameter of the run-level feature tests (branch, lineage,
    detach, retention): a directory, an ``s3://`` URL on moto's server or an ``az://`` URL on Azurite
    (each cloud skips, saying what to install, without its extra or emulator). The cloud's
    credentials are set for this process, and the cache of runs at a URL is under ``tmp_path``."""
    if request.param == "local":
        return str(tmp_path / "runs")
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        return request.getfixturevalue("s3_server").url("runs")
    server = request.getfixturevalue("azure_server")  # found under the real cache, before it moves
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.env()["AZURE_STORAGE_CONNECTION_STRING"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return server.url("runs")


class VLLMServers:
    """vLLM server processes for the session, started here with the documented command as a user
    starts one, one per model shape (started on first use, stopped at the session's end): the
    modules whose runs or collectors sample from a server at ``generation.url`` share it, since each
    run or engine sends the server its own weights first."""

    def __init__(self, work) -> None:
        self._work, self._servers = work, {}

    def of(self, model, tokenizer):
        """The server of ``model``'s shape."""
        from rlhf_pipeline.bench.vllm_server_process import VLLMServerProcess, save_model_dir

        from rlhf_pipeline.generation.settings import find_vllm_python

        shape = model.config.to_json_string()
        if shape not in self._servers:
            work = self._work.mktemp("vllm-serve")
            self._servers[shape] = VLLMServerProcess(find_vllm_python(None),
                                                     save_model_dir(model, tokenizer, work / "model"), work)
        return self._servers[shape]

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()


class EngineUnderTest:
    """How a pipeline test's run generates: ``loop`` (our own sampling loop, the default), ``vllm`` (a
    vLLM engine the collector starts, ``generation.engine=vllm``) or ``url`` (a vLLM server of the
    session's :class:`VLLMServers` and the run pointed at it with ``generation.url``). :meth:`settings`
    gives the run's ``--set`` words for a pipeline whose model is ``model`` (the run sends its weights)."""

    def __init__(self, name: str, servers: VLLMServers | None = None) -> None:
        self.name, self._servers = name, servers

    def settings(self, model, tokenizer) -> list[str]:
        if self.name == "loop":
            return []
        if self.name == "vllm":
            return ["--set", "generation.engine=vllm"]
        return ["--set", f"generation.url={self.server(model, tokenizer).url}"]

    def server(self, model, tokenizer):
        """The vLLM server of ``model``'s shape (started on first use)."""
        return self._servers.of(model, tokenizer)


@pytest.fixture(scope="session")
def vllm_servers(vllm_python, tmp_path_factory):
    """The session's :class:`VLLMServers`; a test that needs one skips, saying how to get it, without
    the vLLM environment."""
    servers = VLLMServers(tmp_path_factory)
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM environment's Python (``rlhf-pipeline setup-vllm``); a test that needs it skips, saying
    how to get it, without it."""
    from rlhf_pipeline.generation.settings import find_vllm_python

    try:
        return find_vllm_python(None)
    except ValueError as exc:
        pytest.skip(f"needs the vLLM environment: {exc}")


@pytest.fixture(scope="module", params=["loop", "vllm", "url"])
def engine(request):
    """The engine parameter of the pipeline tests (:class:`EngineUnderTest`), one per module: a
    guarantee of a run (rows written, exact resume, weights reaching the engine) is one test over
    every engine. The vLLM ones skip, saying how to get it, without the vLLM environment
    (``rlhf-pipeline setup-vllm``)."""
    if request.param == "url":
        return EngineUnderTest(request.param, request.getfixturevalue("vllm_servers"))
    if request.param == "vllm":
        request.getfixturevalue("vllm_python")
    return EngineUnderTest(request.param)


@pytest.fixture()
def one_torch_thread():
    """torch on one thread for the test (deterministic reductions, no oversubscription on a shared
    machine), restored after it (a pipeline's ``set_threads`` may have changed the process-wide
    setting above); a module opts in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------- the quick subset
# `pytest -m "not slow"` is the quick subset the README offers. Slow: every test that trains a pipeline
# end to end or runs a benchmark (these folders), and the modules and tests marked `slow` where they
# stand (kill -9 and multi-process tests, several learner ranks)
SLOW_FOLDERS = ("integration", "bench")


def pytest_collection_modifyitems(config, items):
    for item in items:
        relative = Path(str(item.fspath)).relative_to(TESTS_DIR)
        if relative.parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------- the engine half in two workers
# .ci/run runs the tests that need vLLM or Ray in two workers with `--dist loadfile`: each file runs
# whole in one worker, so what a module builds once (a vLLM engine, a run its tests read) is built once,
# as in one process. Files that share what a second worker would start again count as one file here:
# the session's vLLM server of one model shape (VLLMServers: tens of seconds of CPU each), and Ray, one
# cluster at a time (a second cluster's daemons beside the first on 2 cores; `ray.init()` with no
# address joins one made by `ray start` or named in RAY_ADDRESS, not one another driver started).
# pytest-xdist's `xdist_group` marks would say the same, but its `loadgroup` renames test ids in a way
# pytest 9 ignores, so the grouping is this scheduler's.
SHARED_FILES = (
    ("tests/collect/test_overlap.py", "tests/generation/test_vllm_url.py"),
    ("tests/integration/test_default_pipeline.py", "tests/evaluation/test_eval_engines.py",
     "tests/integration/test_vllm_url_collectors.py"),
    ("tests/cluster/test_ray_lora.py", "tests/integration/test_ray_run.py", "tests/integration/test_ray_multinode.py"),
)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # pytest-xdist's own
    from xdist.scheduler import LoadFileScheduling

    first_of = {path: files[0] for files in SHARED_FILES for path in files}

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return first_of.get(path, path)

    return SharedFileScheduling(config, log)


# ---------------------------------------------------------------- skipped tests, for CI's second pass
# .ci/run first runs the README's test command as a newcomer would (only the `test` extra), then
# installs every extra and runs again just the tests that skipped: this file names them, each with why
# it skipped (a tab between), so CI can run those that wait for the vLLM environment or start Ray
# apart from the rest. Both what a newcomer runs and what the extras cover are then checked, each test
# once where it can run.
SKIPPED_TESTS_FILE = "RLHF_PIPELINE_SKIPPED_TESTS"


def _record_skipped(report) -> None:
    import os

    path = os.environ.get(SKIPPED_TESTS_FILE)
    # under pytest-xdist the controller receives every worker's reports and records them once; a
    # worker (PYTEST_XDIST_WORKER set) leaves it to the controller
    if path and "PYTEST_XDIST_WORKER" not in os.environ:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{report.nodeid}\t{' '.join(str(reason).split())}\n")


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped at import (a module-level importorskip)
        _record_skipped(report)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _record_skipped(report)
