"""A collector of a run at a URL killed with ``kill -9`` while groups are pending, resumed on
"another machine" (a fresh process with an empty cache directory of its own): the pending groups
are found in the shard's own commit record at its URL (its writer state), and the buffer ends with
every group whole, once, equal to an uninterrupted run's. moto's S3 server on loopback; the write path is ``pipelines/default.py``'s.

The collector here sends each group's completions over several writes (as a streaming collector
would), which is what leaves groups pending between writes; the pipeline's own collector writes
whole groups per round.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.files.shard_names import spread_shard_name
from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
from rlhf_pipeline.storage import open_store
from rlhf_pipeline.storage.writer_state import decode

REPO = Path(__file__).resolve().parents[2]
SHARD0 = spread_shard_name(0)  # collector 0's shard at an object-store URL
ROWS = 200  # 50 groups of 4

COLLECTOR = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from helpers import make_batch
    from rlhf_pipeline.files.run_paths import RunPaths
    from rlhf_pipeline.pipeline import load_pipeline_module, make_settings
    from rlhf_pipeline.storage import open_store
    from rlhf_pipeline.storage.torchrl_glue import make_replay_buffer

    module = load_pipeline_module({pipeline!r})
    settings = make_settings(module, ["buffer_backend=zarr", "group_size=4", "buffer_lock_lease_s=3"])
    run = RunPaths.at_url({run_url!r})
    pipeline = module.build(settings, run)
    store = open_store(run.shard_location(0), mode="a", lock_wait_s=60, lock_lease_s=3)
    write_path = pipeline.make_write_path(store)
    rb = make_replay_buffer(store, transforms=write_path)
    pending = write_path[0].pending
    held = set(pending.trajectory_ids().tolist())
    if store.next_row:
        held |= set(store.read_global(torch.arange(store.next_row))["trajectory_id"].tolist())
    print("resumed", pending.num_rows, len(held), flush=True)
    batch = make_batch({rows} // 4, 4, seed=5)
    order = [i for i in torch.randperm({rows}, generator=torch.Generator().manual_seed(3)).tolist() if i not in held]
    sizes = [1, 2, 3, 1, 3, 2] * {rows}
    pos = k = 0
    while pos < len(order):
        rows = order[pos:pos + sizes[k]]
        rb.extend(batch.select(rows))
        print("acked", *rows, flush=True)
        pos += sizes[k]; k += 1
    store.close()
    print("finished", pending.num_rows, flush=True)
""")


def _create_shard(run_url: str) -> None:
    """The run's shard, as ``run`` creates it: the pipeline's ``create_buffer``."""
    module = load_pipeline_module(REPO / "pipelines" / "default.py")
    settings = make_settings(module, ["buffer_backend=zarr", "group_size=4"])
    run = RunPaths.at_url(run_url)
    module.build(settings, run).create_buffer(run.shard_location(0)).close()


def _collector(tmp_path: Path, env: dict, run_url: str, machine: str) -> subprocess.Popen:
    """A collector process on ``machine``: its own working directory and cache directory."""
    where = tmp_path / machine
    where.mkdir()
    script = where / "collector.py"
    script.write_text(COLLECTOR.format(tests=str(REPO / "tests"), pipeline=str(REPO / "pipelines" / "default.py"),
                                       run_url=run_url, rows=ROWS))
    return subprocess.Popen([sys.executable, str(script)], cwd=where, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "XDG_CACHE_HOME": str(where / "cache"), "OMP_NUM_THREADS": "1"})


def _finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, out[-2000:] + err[-3000:]
    return out


def _rows(shard_url: str):
    with open_store(shard_url, mode="r") as store:
        return store.read_global(torch.arange(store.next_row))


def _nothing_local(machine: Path) -> bool:
    return not any(p.is_file() and p.name != "collector.py" for p in machine.rglob("*"))


def test_a_collector_killed_with_pending_groups_resumes_on_another_machine(s3_server, tmp_path, monkeypatch):
    env = s3_server.env()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.setenv(key, env[key])  # this process reads the buffers back
    home = s3_server.url("runs")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("crash", "plain"):
        _create_shard(f"{home}/{name}")

    # the run nobody kills, meanwhile (it ends by itself): its rows do not depend on timing, and its
    # start (importing torch) overlaps the other collectors' instead of following them
    plain = _collector(tmp_path, env, f"{home}/plain", "machine-c")
    first = _collector(tmp_path, env, f"{home}/crash", "machine-a")
    acked: list[int] = []
    try:
        for line in first.stdout:
            acked += [int(x) for x in line.split()[1:]] if line.startswith("acked") else []
            if len(acked) >= 30:
                first.send_signal(signal.SIGKILL)  # lands wherever the collector is by now
                break
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    with open_store(f"{home}/crash/buffer/{SHARD0}", mode="r") as shard:  # published with the shard's rows
        assert decode(shard.writer_state, shard.location)["write_path"][0]["rows"] is not None
    assert _nothing_local(tmp_path / "machine-a")  # the pending groups were never only on its disk

    out = _finish(_collector(tmp_path, env, f"{home}/crash", "machine-b"))
    _, pending_rows, held = out.splitlines()[0].split()
    assert int(pending_rows) > 0, out  # it resumed with groups pending, found at the URL
    assert len(acked) <= int(held) < ROWS  # every acknowledged row was stored or pending; the kill came midway
    assert out.splitlines()[-1] == "finished 0"
    assert _nothing_local(tmp_path / "machine-b")

    assert _finish(plain).splitlines()[-1] == "finished 0"
    crashed, plain = _rows(f"{home}/crash/buffer/{SHARD0}"), _rows(f"{home}/plain/buffer/{SHARD0}")
    ids = crashed["trajectory_id"]
    assert sorted(ids.tolist()) == list(range(ROWS))  # every row once
    assert torch.bincount(crashed["group_id"]).tolist() == [4] * (ROWS // 4)  # every group whole
    # the same rows, advantages included, as the run nobody killed (the order within one append may differ)
    assert crashed.select(torch.argsort(ids)).equal(plain.select(torch.argsort(plain["trajectory_id"])))
