"""A server started by ``vllm_process.ServerProcess`` ends with the process that started it, whole and
by any signal: here the server is a stand-in as stubborn as vLLM's API server was seen to be (it
ignores SIGTERM, and so does the child it starts, as an engine core), so no test needs vLLM; the
same check with a real vLLM engine is ``test_vllm_engine.py``'s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from process_tree import kill_left, tree, wait_gone

from rlhf_pipeline.generation.vllm_process import WATCHER_MARK, ServerProcess

STUBBORN_SERVER = r"""
import http.server, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                        "time.sleep(3600)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

OWNER = """
import sys, time
from pathlib import Path
from rlhf_pipeline.generation.vllm_process import ServerProcess
server = ServerProcess([sys.executable, "-c", sys.argv[1], "{port}"], {}, Path(sys.argv[2]), 120.0)
print(server.pid, flush=True)
time.sleep(600)
"""


def group_of(pid: int) -> list[str]:
    """The command lines of the processes in ``pid``'s process group."""
    found = []
    for pid_, group in tree(pid).items():
        if group == pid:
            found.append(open(f"/proc/{pid_[0]}/cmdline", "rb").read().decode(errors="replace"))
    return found


@pytest.mark.parametrize("signal_", [signal.SIGKILL, signal.SIGTERM])
def test_no_process_of_a_server_outlives_the_process_that_started_it(tmp_path, signal_):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, STUBBORN_SERVER, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    started = {}
    try:
        server = int(owner.stdout.readline())  # printed once the server is healthy
        started = tree(owner.pid)
        in_group = [pid for (pid, _), group in started.items() if group == server]
        assert server in in_group and len(in_group) >= 2, started  # the server, its stubborn child
        os.kill(owner.pid, signal_)
        owner.wait()
        assert not wait_gone(started), "a process of the server's group outlived the process that started it"
    finally:
        owner.kill()
        owner.wait()
        kill_left(started)


def test_a_stopped_server_leaves_nothing_and_its_pid_is_the_servers(tmp_path):
    server = ServerProcess([sys.executable, "-c", STUBBORN_SERVER, "{port}"], {}, tmp_path, 120.0)
    try:
        commands = group_of(server.pid)
        assert STUBBORN_SERVER in open(f"/proc/{server.pid}/cmdline", "rb").read().decode()  # the server itself
        assert sum(WATCHER_MARK in c for c in commands) == 1 and len(commands) == 3, commands
        started = tree(server.pid)
    finally:
        server.stop(wait_s=1.0)  # it ignores SIGTERM: killed after 1 s
    assert server.exited() == "killed by SIGKILL"
    assert not wait_gone(started)


def test_a_server_python_that_is_not_there_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-python"):
        ServerProcess([str(tmp_path / "no-such-python"), "-c", "pass"], {}, tmp_path, 10.0)


STAND_IN = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from misbehaving_vllm_server import MisbehavingVLLMServer
from rlhf_pipeline.models import tiny_model_and_tokenizer
model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=1)
MisbehavingVLLMServer(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, port=int(sys.argv[2]),
                      served_name=sys.argv[3])
threading.Event().wait()
"""


def test_an_engine_dropped_without_close_is_collected_and_stops_its_server(tmp_path):
    """What the server object holds (the engine's stats, the reload a restart calls) does not keep the
    engine alive, so an engine nobody closed is collected, and its finalizer stops the server it
    started. The server here is the stand-in of ``misbehaving_vllm_server.py``, started as vLLM would be
    and serving the same tiny model: the engine's checks pass against it, and no vLLM is needed."""
    import gc
    import weakref
    from pathlib import Path

    from rlhf_pipeline.generation.vllm_engine import SERVED_NAME, OwnedServer, VLLMEngine
    from rlhf_pipeline.models import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=1)
    tests = str(Path(__file__).resolve().parents[1])
    server = OwnedServer([sys.executable, "-c", STAND_IN, tests, "{port}", SERVED_NAME], dict(os.environ), tmp_path,
                         120.0, "vllm", own_work_dir=False)
    engine = VLLMEngine(server, model, stop_token_ids=[tok.eos_token_id])
    started = tree(engine.pid)
    try:
        collected = weakref.ref(engine)
        del engine
        gc.collect()
        assert collected() is None, [type(r).__name__ for r in gc.get_referrers(collected())]
        assert server.process.exited() is not None
        assert not wait_gone(started), "the server outlived its engine"
    finally:
        server.stop()
        kill_left(started)
