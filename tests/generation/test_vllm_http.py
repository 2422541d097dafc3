"""The HTTP client under the URL engine (``generation/vllm_http.py``) against a real HTTP server on
loopback (the standard library's, answering as a busy or failing server does), and the
``generation.url`` settings checks; neither needs vLLM."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_pipeline.generation.settings import GenerationSettings, check_generation
from rlhf_pipeline.generation.vllm_http import JsonClient, Retries, ServerError, ServerUnreachable

QUICK = Retries(retries=3, backoff_s=0.01, timeout_s=10.0)


class Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next (status, body) of the server's ``script``, then 200s."""

    def do_POST(self):  # noqa: N802 (the standard library's name)
        length = int(self.headers.get("Content-Length", 0))
        self.server.bodies.append(json.loads(self.rfile.read(length) or b"null"))
        self._answer()

    def do_GET(self):  # noqa: N802
        self.server.bodies.append(None)
        self._answer()

    def _answer(self):
        self.server.authorizations.append(self.headers.get("Authorization"))
        status, body = self.server.script.pop(0) if self.server.script else (200, {"ok": True})
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):  # quiet
        pass


class KeepingAlive(Scripted):
    """As ``Scripted``, over HTTP/1.1: the connection stays open after a reply unless the server's
    ``drop_idle`` says to close it without telling the client (as uvicorn does to an idle one)."""

    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        with self.server.counting:
            self.server.connections += 1

    def _answer(self):
        super()._answer()
        if self.server.drop_idle:
            self.close_connection = True


def serving(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.script, server.bodies, server.authorizations = [], [], []
    server.counting, server.connections, server.drop_idle = threading.Lock(), 0, False
    server.daemon_threads = True  # a kept-alive connection's handler thread waits on the client
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server


@pytest.fixture()
def scripted():
    server = serving(Scripted)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture()
def keeping_alive():
    server = serving(KeepingAlive)
    yield server
    server.shutdown()
    server.server_close()


def test_requests_reuse_one_kept_alive_connection_per_thread_in_flight(keeping_alive):
    client = JsonClient(f"http://127.0.0.1:{keeping_alive.server_port}", QUICK)
    for seed in range(10):
        assert client.post("/v1/completions", {"seed": seed}) == {"ok": True}
    assert keeping_alive.connections == 1 and client.connections_opened == 1
    senders = [threading.Thread(target=lambda: [client.post("/v1/completions", {"seed": s}) for s in range(10)])
               for _ in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    # as many connections as requests were ever in flight together, not one per request
    assert len(keeping_alive.bodies) == 50 and keeping_alive.connections <= 4
    assert client.requests_sent == 50 and client.connections_opened == keeping_alive.connections
    client.close()


def test_a_kept_connection_the_server_closed_is_replaced_without_a_retry(keeping_alive):
    keeping_alive.drop_idle = True  # every connection closed after its first reply, the client not told
    client = JsonClient(f"http://127.0.0.1:{keeping_alive.server_port}",
                        Retries(retries=0, backoff_s=0.01, timeout_s=10.0))
    for seed in range(5):  # no retries allowed: the new connection is not one
        assert client.post("/v1/completions", {"seed": seed}) == {"ok": True}
    assert keeping_alive.bodies == [{"seed": seed} for seed in range(5)]  # each request answered once
    assert keeping_alive.connections == 5
    client.close()


def test_error_answers_keep_the_connection_alive(keeping_alive):
    keeping_alive.script = [(503, {"error": {"message": "restarting"}}), (400, {"error": {"message": "bad n"}})]
    client = JsonClient(f"http://127.0.0.1:{keeping_alive.server_port}", QUICK)
    with pytest.raises(ServerError, match="HTTP 400: bad n"):
        client.post("/v1/completions", {"n": 0})
    assert client.post("/v1/completions", {"n": 1}) == {"ok": True}
    assert keeping_alive.connections == 1 and len(keeping_alive.bodies) == 3
    client.close()


def test_busy_answers_are_retried_with_the_same_body_until_one_succeeds(scripted):
    scripted.script = [(503, {"error": {"message": "restarting"}}), (429, {}), (502, {})]
    client = JsonClient(f"http://127.0.0.1:{scripted.server_port}", QUICK)
    assert client.post("/v1/completions", {"seed": 7}) == {"ok": True}
    assert scripted.bodies == [{"seed": 7}] * 4  # three busy answers, then the one that counted


def test_retries_are_bounded_and_end_in_one_line(scripted):
    scripted.script = [(503, {"error": {"message": "restarting"}})] * 10
    client = JsonClient(f"http://127.0.0.1:{scripted.server_port}", QUICK)
    with pytest.raises(ServerUnreachable, match=r"after 4 tries .*HTTP 503: restarting") as caught:
        client.post("/v1/completions", {})
    assert "\n" not in str(caught.value) and len(scripted.bodies) == 4


def test_an_error_answer_is_the_servers_and_not_retried(scripted):
    scripted.script = [(400, {"error": {"message": "top_k must be -1, 0 or >= 1"}})]
    client = JsonClient(f"http://127.0.0.1:{scripted.server_port}", QUICK)
    with pytest.raises(ServerError, match="HTTP 400: top_k must be") as caught:
        client.post("/v1/completions", {})
    assert caught.value.status == 400 and len(scripted.bodies) == 1


@pytest.mark.parametrize(("changes", "named"), [
    ({"url": "ftp://host"}, "'generation.url'"),
    ({"url": "http://h:1", "engine": "vllm"}, "generation.engine=vllm"),
    ({"url": "http://h:1", "retries": -1}, "'generation.retries'"),
    ({"url": "http://h:1", "backoff_s": -1.0}, "'generation.backoff_s'"),
    ({"url": "http://h:1", "weight_transfer": "nccl"}, "'generation.weight_transfer=nccl' is for generation.engine=vllm; this run generates with the server"),
    ({"url": "http://h:1", "url_check_tolerance": 0.0}, "'generation.url_check_tolerance'"),
])
def test_url_settings_are_refused_by_name(changes, named):
    with pytest.raises(ValueError, match=named):
        check_generation(GenerationSettings(**changes))


def test_a_url_needs_no_vllm_here_and_no_cpu_head_size():
    # the server is the user's: its Python and attention are its business, not this machine's
    check_generation(GenerationSettings(url="http://127.0.0.1:8000"), head_size=16)


def test_a_second_collector_of_the_default_pipeline_connects_to_the_shared_server(tmp_path):
    from rlhf_pipeline.pipeline import PipelineError, RunPaths, load_pipeline_module, make_settings
    from rlhf_pipeline.runs.processes import build_pipeline

    module = load_pipeline_module(Path(__file__).resolve().parents[2] / "pipelines" / "default.py")
    # nothing listens at the URL: collector 1 is not refused for its index, it goes to the server
    settings = make_settings(module, ["generation.url=http://127.0.0.1:9", "generation.start_timeout_s=0",
                                      "generation.retries=0", "num_heads=2"])
    pipeline = build_pipeline(module, settings, RunPaths(tmp_path))
    with pytest.raises(PipelineError, match="no vLLM server answered at http://127.0.0.1:9") as caught:
        pipeline.make_collector(pipeline.make_model(), pipeline.create_buffer(tmp_path / "shard"), collector_index=1)
    assert "--collectors 1" not in str(caught.value)


def test_a_server_that_wants_an_api_key_is_refused_naming_the_variable(scripted, monkeypatch):
    from rlhf_pipeline.generation.settings import make_engine
    from rlhf_pipeline.generation.vllm_url import ServerMismatch
    from rlhf_pipeline.models import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2)
    settings = GenerationSettings(url=f"http://127.0.0.1:{scripted.server_port}", retries=0)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    scripted.script = [(200, {}), (401, {"error": "Unauthorized"})]  # /health is open, /v1 is guarded
    with pytest.raises(ServerMismatch, match=r"wants an API key: set \$VLLM_API_KEY"):
        make_engine(settings, model, pad_token_id=0, stop_token_ids=[tok.eos_token_id], tokenizer=tok)
    monkeypatch.setenv("VLLM_API_KEY", "sesame")
    scripted.script = [(200, {}), (401, {"error": "Unauthorized"})]
    with pytest.raises(ServerMismatch, match=r"refused the key in \$VLLM_API_KEY"):
        make_engine(settings, model, pad_token_id=0, stop_token_ids=[tok.eos_token_id], tokenizer=tok)
    assert scripted.authorizations == [None, None, "Bearer sesame", "Bearer sesame"]


def test_a_restart_line_goes_to_the_stderr_of_the_moment_it_is_said(capsys):
    # a quiet replay rank redirects sys.stderr after this module was imported: the line must follow it
    Retries().announce("[collector 0] restarting the vLLM server")
    assert capsys.readouterr().err == "[collector 0] restarting the vLLM server\n"


def test_a_server_that_stops_answering_is_said_once_until_it_answers_again(scripted):
    # without the line, a collector whose server died said nothing for the minute its retries took
    said = []
    retries = Retries(retries=2, backoff_s=0.01, timeout_s=10.0, announce=said.append)
    client = JsonClient(f"http://127.0.0.1:{scripted.server_port}", retries)
    scripted.script = [(503, {"error": {"message": "restarting"}})] * 12
    failed = []

    def ask():
        try:
            client.post("/v1/completions", {})
        except ServerUnreachable:
            failed.append(True)

    senders = [threading.Thread(target=ask) for _ in range(4)]  # a round's requests meet the same silence
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    assert len(failed) == 4 and client.silent and len(said) == 1
    assert said[0].startswith(f"the vLLM server at http://127.0.0.1:{scripted.server_port} did not answer POST "
                              f"/v1/completions (HTTP 503: restarting): asking again, 2 more tries over 0 s")
    assert client.post("/v1/completions", {}) == {"ok": True} and not client.silent and len(said) == 1
    scripted.script = [(503, {})]  # a new silence, after an answer: said again
    assert client.post("/v1/completions", {}) == {"ok": True} and len(said) == 2


def test_a_round_lease_on_a_server_that_does_not_answer_ends_without_waiting_its_retries_again(scripted):
    from rlhf_pipeline.generation.vllm_url_weights import RoundLease

    client = JsonClient(f"http://127.0.0.1:{scripted.server_port}", QUICK)
    scripted.script = [(503, {})] * 20
    lease = RoundLease(client, "weights", 3, ttl_s=60.0, load=lambda _: None, reset=lambda: None)
    with pytest.raises(ServerUnreachable, match="after 4 tries"):
        lease.__enter__()
    # the acquire's four tries, then one release (it expires on the server anyway), not four more
    assert [json.loads(body["args"][0])["op"] for body in scripted.bodies] == ["acquire"] * 4 + ["release"]
