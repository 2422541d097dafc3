"""A round waiting for a shared server at ``generation.url`` (the weights lease,
``generation/vllm_url_weights.py``) while other weights hold it: it gives its place in line up when its
process stops (a signal, its launcher gone), and an engine closed with requests still queued lets the
server go. Before, a collector whose launcher died kept asking for the lease for as long as the other
weights held the server, and its ticket kept every later round of other weights in line behind it.

The server is ``misbehaving_vllm_server.py``'s stand-in, answering honestly: it keeps the lease table
our worker extension keeps inside vLLM (``generation/vllm_lease.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from engine_contract import chat_prompts, seeds
from helpers import run_child_pids
import preloaded
from misbehaving_vllm_server import MisbehavingVLLMServer

from rlhf_pipeline.generation import EngineStopped, GenerationEngine, SampleRequest, SamplingConfig
from rlhf_pipeline.generation.vllm_http import JsonClient
from rlhf_pipeline.generation.vllm_url import VLLMURLEngine
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
SAMPLING = SamplingConfig(max_new_tokens=4, temperature=1.0)
HANG_BOUND_S = 300  # a process that is still waiting after this long waits forever (not a timing assertion)


def default_model(seed: int):
    """The default pipeline's model shape, with weights of its own."""
    tok = char_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=4, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, seed=seed), tok


@pytest.fixture(scope="module")
def server():
    model, tok = default_model(seed=1)
    served = MisbehavingVLLMServer(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    yield served
    served.stop()


def lease_table(server) -> dict:
    reply = JsonClient(server.url).post("/collective_rpc", {"method": "published_lease",
                                                            "args": [json.dumps({"op": "describe"})]})
    return reply["results"][0]


def engine_of(server, seed: int, **options) -> VLLMURLEngine:
    model, tok = default_model(seed)
    return VLLMURLEngine(server.url, model, stop_token_ids=[tok.eos_token_id], tokenizer=tok, **options)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {HANG_BOUND_S} s"
        time.sleep(0.05)


@pytest.fixture
def stopping():
    """The stop of this process, as a process of ``run`` gives it to every engine it makes."""
    GenerationEngine.stopping = event = threading.Event()
    yield event
    GenerationEngine.stopping = None


def test_a_round_waiting_for_other_weights_gives_its_place_up_when_its_process_stops(server, stopping):
    tok = char_tokenizer()
    ended: list[BaseException] = []
    with engine_of(server, seed=2, policy_version=7) as holder, engine_of(server, seed=3, policy_version=9) as waiter:

        def sample() -> None:
            try:
                waiter.sample([SampleRequest(p, n=2) for p in chat_prompts(tok, 2)], seeds(0, 2), SAMPLING)
            except BaseException as exc:  # noqa: BLE001 (what ended it is the assertion)
                ended.append(exc)

        with holder.weights.round_lease():  # the server held on the holder's weights for as long as this block runs
            sampling = threading.Thread(target=sample)
            sampling.start()
            wait_until(lambda: lease_table(server)["waiting"] == 1, "waiting for the lease")
            stopping.set()
            sampling.join(HANG_BOUND_S)
            assert not sampling.is_alive(), "the waiting round did not end on its stop"
            assert len(ended) == 1 and isinstance(ended[0], EngineStopped), ended
            assert server.url in str(ended[0]) and "nothing of the round was sampled" in str(ended[0])
            table = lease_table(server)
            assert table["waiting"] == 0 and table["held_version"] == 7  # its ticket gone, the holder's kept
    assert lease_table(server)["rounds_in_flight"] == 0


def test_an_engine_closed_with_requests_still_queued_lets_the_server_go(server):
    tok = char_tokenizer()
    engine = engine_of(server, seed=4, policy_version=3, max_concurrency=1)
    requests = [SampleRequest(p, n=2) for p in chat_prompts(tok, 4)]
    futures = [engine.submit(r, s, SAMPLING) for r, s in zip(requests, seeds(0, 4))]
    assert lease_table(server)["rounds_in_flight"] == 1
    engine.close()  # the queued requests are cancelled, never answered
    assert sum(f.cancelled() for f in futures) >= 1  # else nothing here was left unanswered
    table = lease_table(server)
    assert table["rounds_in_flight"] == 0 and table["waiting"] == 0, table
    with engine_of(server, seed=5, policy_version=4) as other:  # other weights get the server at once
        groups = other.sample(requests[:1], seeds(0, 1), SAMPLING)
        assert groups[0].policy_version == 4


def test_a_collector_whose_launcher_died_stops_waiting_for_a_server_held_on_other_weights(server, tmp_path):
    settings = ["warm_start_steps=2", "prompts_per_round=2", "group_size=2", "learner.batch_size=4",
                "learner.sample_window=8", "learner.new_rows_per_step=4", f"generation.url={server.url}"]
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", "4", "--home",
               str(tmp_path), "--run-name", "orphan", *[w for s in settings for w in ("--set", s)]]
    with engine_of(server, seed=6, policy_version=70) as holder, holder.weights.round_lease():
        launcher = preloaded.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            wait_until(lambda: lease_table(server)["waiting"] >= 1 or launcher.poll() is not None,
                       "a round of the run waiting for the lease")
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            collectors = run_child_pids("collect", str(tmp_path), "orphan")
            assert collectors, "the run's collector is not found"
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait()
            # its children see the launcher's stop pipe close: the waiting collector gives its place up
            wait_until(lambda: not any(_alive(pid) for pid in collectors), "ended (the collector)")
            assert lease_table(server)["waiting"] == 0
            assert lease_table(server)["held_version"] == 70  # the holder's round was never disturbed
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            for role in ("collect", "learn"):
                for pid in run_child_pids(role, str(tmp_path), "orphan"):
                    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie that nobody reaps, its parent killed, counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
