"""``--ray ADDRESS`` (or ``RAY_ADDRESS``) where no cluster answers: refused in one line before anything is
made. ``ray.init`` would retry such an address for minutes with warnings of its own, then hang."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.cluster.driver import why_unreachable

DEFAULT_PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "default.py"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_address_that_takes_a_connection_is_reachable_and_one_that_refuses_it_is_named():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert why_unreachable(f"127.0.0.1:{port}") is None
        assert why_unreachable(f"ray://127.0.0.1:{port}") is None  # Ray Client's form
    assert why_unreachable(f"127.0.0.1:{closed_port()}") == "Connection refused"
    assert why_unreachable("auto") is None  # Ray's own words: it resolves them


@pytest.mark.parametrize("how", ["--ray ADDRESS", "RAY_ADDRESS"])
def test_run_on_an_address_where_no_cluster_answers_is_refused_before_anything_is_made(how, tmp_path, monkeypatch,
                                                                                       capsys):
    pytest.importorskip("ray", reason="--ray needs the ray extra (pip install -e '.[ray]')")
    address = f"127.0.0.1:{closed_port()}"
    argv = ["run", str(DEFAULT_PIPELINE), "--home", str(tmp_path), "--run-name", "r", "--steps", "2", "--ray"]
    if how == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        argv.append(address)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    name = "--ray" if how == "--ray ADDRESS" else "RAY_ADDRESS"
    assert err == (f"rlhf-pipeline run: error: {name} {address}: no Ray cluster answers there (Connection refused); "
                   f"start one with `ray start --head` on that machine, or give the address `ray status` prints "
                   f"there"), err
    assert list(tmp_path.iterdir()) == []
