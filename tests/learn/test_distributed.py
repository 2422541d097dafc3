"""The data-parallel learner: N ranks under a real ``torchrun`` (gloo, CPU) train like one rank."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from data_parallel_worker import (
    ROWS,
    ROWS_PER_SHARD,
    SETTINGS,
    SHARDS,
    STOP_AT_STEP,
    THREE_SHARDS_SETTINGS,
    make_model,
    make_run,
    make_sharded_run,
    rows,
    train,
)
from test_trajectories import OPTIONAL, multi_turn_rows
from rlhf_pipeline.learn.checkpoint import CheckpointManager
from rlhf_pipeline.learn.distributed import DataParallel
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.learn.learner import Prefetcher
from rlhf_pipeline.pipeline import RunPaths
from rlhf_pipeline.schema import StoreSchema, TerminationReason
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.coordination.weights import latest_version, load_weights, publish_weights

pytestmark = pytest.mark.slow  # processes of their own (the quick subset leaves it out)

WORKER = Path(__file__).with_name("data_parallel_worker.py")
STEPS = 4  # epoch 1 is batches of 16, 16 and 1 rows; step 4 opens epoch 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job(root: Path, steps: int, mode: str = "", buffer: str | None = None) -> dict:
    """One run for the worker's ranks to train (data_parallel_worker.py names the modes)."""
    return {"root": str(root), "steps": steps, "mode": mode, "buffer": buffer}


def torchrun(ranks: int, root: Path, steps: int, mode: str = "", buffer: str | None = None,
             env: dict[str, str] | None = None) -> None:
    torchrun_jobs(ranks, [job(root, steps, mode, buffer)], env=env)


def torchrun_jobs(ranks: int, jobs: list[dict], env: dict[str, str] | None = None) -> None:
    """``ranks`` processes under a real torchrun train ``jobs`` in order, in one process group."""
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    jobs_file = Path(jobs[0]["root"]).parent / f"jobs-{Path(jobs[0]['root']).name}.json"
    jobs_file.write_text(json.dumps(jobs))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(jobs_file)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-8000:]


def losses(root: Path) -> list[float]:
    """Each step's loss and gradient norm (Adam's update hides a gradient off by a constant factor; the norm does not)."""
    return [(m["losses/loss"], m["losses/grad_norm"]) for m in read_metrics(RunPaths(root).metrics)]


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    _, state = CheckpointManager(root / "checkpoints").load()
    return state["model"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The reference: the plain learner, in this process, over the whole global batch."""
    root = tmp_path_factory.mktemp("dp") / "one-rank"
    make_run(root)
    train(root, STEPS)
    return root


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, Path]:
    """Every run two ranks train in this module, by one set of ranks under one torchrun (starting the
    ranks costs more than the steps they train): the run directory of each, by name. Tests copy a run
    before they train it further."""
    base = tmp_path_factory.mktemp("dp-two-ranks")
    runs = {name: base / name for name in ("plain", "at-step-2", "stopped", "fsdp", "blow-up", "blow-up-fsdp",
                                           "turns", "turns-fsdp", "turns-at-step-2", "shards", "live")}
    for name in ("plain", "at-step-2", "stopped", "fsdp", "blow-up", "blow-up-fsdp", "live"):
        make_run(runs[name])
    for name in ("turns", "turns-fsdp", "turns-at-step-2"):
        make_multi_turn_run(runs[name])
    make_sharded_run(runs["shards"], shards=3)
    jobs = [job(runs["plain"], STEPS), job(runs["at-step-2"], 2),  # checkpoint_every=2: the checkpoint at step 2
            job(runs["stopped"], STEPS, "stop"), job(runs["fsdp"], STEPS, "fsdp"),
            # the blow-up runs: trained to their checkpoint at step 2, then at a learning rate of 1e30
            job(runs["blow-up"], 2), job(runs["blow-up"], STEPS, "blow-up"),
            job(runs["blow-up-fsdp"], 2), job(runs["blow-up-fsdp"], STEPS, "blow-up-fsdp"),
            job(runs["turns"], MULTI_TURN_STEPS, "turns"), job(runs["turns-fsdp"], MULTI_TURN_STEPS, "turns-fsdp"),
            job(runs["turns-at-step-2"], 2, "turns"), job(runs["shards"], STEPS, "shards-of-3"),
            job(runs["live"], STEPS, "live")]  # last: its collector stand-in appends until the ranks exit
    with growing_buffer(runs["live"]):
        torchrun_jobs(2, jobs)
    return runs


@contextlib.contextmanager
def growing_buffer(root: Path):
    """A collector stand-in appending 8 rows at a time to the buffer of ``root`` once its learner has
    set up (imports take long on a loaded machine: rows arrive as it trains), until the block ends."""
    source = rows(ROWS + 8 * 2000)
    stop = threading.Event()

    def collect() -> None:
        while not RunPaths(root).pacing.exists() and not stop.wait(0.05):
            pass
        store = open_store(RunPaths(root).buffer, mode="a", durable=False)
        try:
            for start in range(ROWS, len(source), 8):
                if stop.wait(0.03):
                    break
                store.append(source.select(slice(start, start + 8)))
        finally:
            store.close()

    writer = threading.Thread(target=collect)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


def test_torchrun_environment_names_the_ranks():
    assert DataParallel.from_torchrun_env({}) == DataParallel()
    dp = DataParallel.from_torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (dp.rank, dp.world_size, dp.local_rank, dp.is_main) == (1, 2, 1, False)
    with pytest.raises(ValueError, match="RANK='x'.*torchrun"):
        DataParallel.from_torchrun_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        DataParallel(rank=2, world_size=2)


def test_a_rank_whose_gpu_this_machine_lacks_is_refused_naming_the_world_size(monkeypatch):
    """Rank 2 of 3 on a machine of 2 GPUs: ``torch.cuda.set_device`` refused it with a traceback ("invalid
    device ordinal"). This machine has no GPU: torch's count of them is given, and what the rank would call
    next is recorded instead of run."""
    from rlhf_pipeline.learn.errors import TooFewDevices

    called: list = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", called.append)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: called.append(backend))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(TooFewDevices) as refused:
        DataParallel(rank=2, world_size=3, local_rank=2).start(torch.device("cuda"))
    assert str(refused.value) == ("learner rank 2 of learner.world_size=3 trains on its own GPU, cuda:2, and this "
                                  "machine shows 2 (CUDA_VISIBLE_DEVICES=unset): set learner.world_size to 2 or fewer, "
                                  "or spread the ranks over machines (torchrun --nnodes, or --ray)")
    assert called == []  # nothing started
    DataParallel(rank=1, world_size=3, local_rank=1).start(torch.device("cuda"))
    assert called == [torch.device("cuda", 1), "nccl"]


def test_ranks_take_disjoint_slices_covering_the_draw():
    positions = torch.arange(10, 15)
    slices = [DataParallel(rank=r, world_size=2).local_positions(positions) for r in range(2)]
    assert [s.tolist() for s, _ in slices] == [[10, 11, 12], [13, 14]]
    assert not any(filler for _, filler in slices)
    # fewer rows than ranks: the rank without one gets a filler (a row it trains with weight 0)
    mine, filler = DataParallel(rank=1, world_size=2).local_positions(torch.tensor([7]))
    assert mine.tolist() == [7] and filler


def test_two_ranks_train_like_one(one_rank, two_rank_runs):
    root = two_rank_runs["plain"]
    expected = losses(one_rank)
    assert len(expected) == STEPS and len(losses(root)) == STEPS  # rank 0 alone wrote the metrics
    torch.testing.assert_close(losses(root), expected, rtol=1e-4, atol=1e-6)
    reference, trained = final_weights(one_rank), final_weights(root)
    for key in reference:
        torch.testing.assert_close(trained[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)
    # the weights moved: equal weights are not the untrained ones
    initial = make_model().state_dict()
    assert any(not torch.allclose(trained[k], initial[k]) for k in trained)
    assert latest_version(root) == latest_version(one_rank) == STEPS
    # the batch charts cover every rank's rows: the global batch sizes of the epoch
    assert [m["charts/rows"] for m in read_metrics(RunPaths(root).metrics)] == [16, 16, ROWS - 32, 16]


def test_a_two_rank_checkpoint_resumes_on_one_rank(one_rank, two_rank_runs, tmp_path):
    root = tmp_path / "resumed"
    shutil.copytree(two_rank_runs["at-step-2"], root)
    assert CheckpointManager(root / "checkpoints").latest_step() == SETTINGS.checkpoint_every
    train(root, STEPS)  # the same run directory, now one rank
    torch.testing.assert_close(losses(root), losses(one_rank), rtol=1e-4, atol=1e-6)
    reference, resumed = final_weights(one_rank), final_weights(root)
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_data_parallel_prefetcher_delivers_every_draw_it_made_after_a_stop():
    """A rank's prefetcher keeps what its thread made after a stop request (rank 0 shared that draw:
    every rank must train it); the thread's own InterruptedError (rank 0's MainStopped) ends it."""
    stop = threading.Event()

    def produce(draw: int) -> int:
        if draw == 2:
            stop.set()  # while draw 2 is made
        if draw == 3:
            raise InterruptedError("rank 0 stopped drawing")
        return draw

    prefetcher = Prefetcher(produce, 0, depth=1, stop=stop, keep_every_item=True)
    try:
        assert [prefetcher.next()[1] for _ in range(3)] == [0, 1, 2]
        with pytest.raises(InterruptedError):
            prefetcher.next()
    finally:
        prefetcher.close(timeout_s=5)


def test_a_stop_that_reaches_rank_zero_alone_stops_every_rank_and_resumes_exactly(one_rank, two_rank_runs, tmp_path):
    """Every rank prefetches: rank 0 has shared draws ahead of the step that stops, and rank 1 has read
    its slices of them. Both ranks stop at the same step (neither waits for the other forever), the
    checkpoint names the draws trained, and the draws shared ahead are drawn again on resume."""
    root = tmp_path / "stopped"
    shutil.copytree(two_rank_runs["stopped"], root)
    assert CheckpointManager(root / "checkpoints").latest_step() == STOP_AT_STEP
    assert len(losses(root)) == STOP_AT_STEP
    train(root, STEPS)  # resumed on one rank
    torch.testing.assert_close(losses(root), losses(one_rank), rtol=1e-4, atol=1e-6)
    reference, resumed = final_weights(one_rank), final_weights(root)
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def test_two_ranks_train_on_rank_zeros_draws_while_the_buffer_grows(two_rank_runs):
    """A collector stand-in appends to the buffer while 2 ranks train with a sampler that waits
    for new rows: each rank refreshing and drawing on its own would see other rows."""
    root = two_rank_runs["live"]
    rank0, rank1 = ([json.loads(line) for line in (root / f"rows-rank{r}.jsonl").read_text().splitlines()]
                    for r in range(2))
    assert [line["step"] for line in rank0] == [line["step"] for line in rank1] == list(range(1, STEPS + 1))
    for mine, theirs in zip(rank0, rank1):
        # rank 0's draw, split in two slices in rank order: ids are positions here (see rows())
        assert len(mine["draw"]) == 16 and mine["rows"] + theirs["rows"] == mine["draw"]
        assert len(theirs["rows"]) == 8
    # the draws followed the growing buffer: the last ones hold rows appended after the start
    assert max(rank0[-1]["draw"]) >= ROWS
    assert len(losses(root)) == STEPS


@pytest.fixture(scope="module")
def one_rank_shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp-shards") / "one-rank"
    make_sharded_run(root)
    train(root, STEPS, mode="shards")
    return root


def assert_trains_like(root: Path, reference: Path) -> None:
    torch.testing.assert_close(losses(root), losses(reference), rtol=1e-4, atol=1e-6)
    expected, trained = final_weights(reference), final_weights(root)
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def one_rank_three_shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp-three-shards") / "one-rank"
    make_sharded_run(root, shards=3)
    train(root, STEPS, mode="shards-of-3")
    return root


def test_two_ranks_over_three_shards_read_their_own_shards_and_train_like_one(one_rank_three_shards, two_rank_runs):
    """Shard affinity: rank r trains the rows of the shards k with k mod 2 == r (rank 0 two shards, rank 1
    one: slices of unequal sizes), every step; the global batch is still the exact sampler's even share of
    every shard, so the losses and weights are one rank's. (Two ranks, in the module's one set of ranks:
    three of their own cost as much again; three ranks over four shards: the S3 tests below.)"""
    root = two_rank_runs["shards"]
    assert_trains_like(root, one_rank_three_shards)
    per_rank = [[json.loads(line) for line in (root / f"rows-rank{r}.jsonl").read_text().splitlines()]
                for r in range(2)]
    for step in range(STEPS):
        shards_of = [{tid // ROWS_PER_SHARD for tid in lines[step]["rows"]} for lines in per_rank]
        assert shards_of == [{0, 2}, {1}], (step, shards_of)
        trained_ids = sorted(tid for lines in per_rank for tid in lines[step]["rows"])
        share = THREE_SHARDS_SETTINGS.batch_size // 3  # oldest first in each shard
        assert trained_ids == [k * ROWS_PER_SHARD + step * share + i for k in range(3) for i in range(share)]


def _view_requests(sent) -> list[tuple[str, str]]:
    """A listing of the buffer, or a GET of a shard's commit record: what refreshing a view sends."""
    return [(method, path) for method, path in sent if "list-type=2" in path or path.endswith("/zarr.json")]


def _s3_sharded_buffer(s3_server) -> str:
    """The buffer of make_sharded_run, as Zarr shards on moto's S3 server; its URL."""
    from rlhf_pipeline.storage.zarr import ZarrTrajectoryStore

    url = s3_server.url("buffer")
    source = rows(SHARDS * ROWS_PER_SHARD)
    for k in range(SHARDS):
        with ZarrTrajectoryStore.create(f"{url}/shard-{k:04d}", StoreSchema(optional=("advantage",)),
                                        segment_rows=8, storage_options=s3_server.options) as store:
            store.append(source.select(slice(k * ROWS_PER_SHARD, (k + 1) * ROWS_PER_SHARD)))
    return url


def test_ranks_over_a_url_buffer_take_rank_zeros_refresh_and_get_only_their_rows(s3_server, one_rank_shards,
                                                                                   tmp_path, monkeypatch):
    """The buffer's shards on moto's S3 server, 3 ranks each signing with its own key: ranks 1 and 2
    send no listing and no record GET, not even to open the buffer (rank 0's records come at setup and
    with its draws, and every refresh asked for would be sent), only their rows' units; they train
    like one rank."""
    url = _s3_sharded_buffer(s3_server)
    for name, value in s3_server.env().items():  # what opening the buffer sends, as a rank opens it
        monkeypatch.setenv(name, value)
    with s3_server.requests.recording() as sent:
        open_buffer(url).close()
    opening = sorted(_view_requests(sent))
    # one LIST and one GET of each shard's record (no second GET right after opening, none to detect the backend)
    assert sorted(path.rsplit("/", 2)[-2] if path.endswith("/zarr.json") else "LIST" for _, path in opening) == \
        ["LIST"] + [f"shard-{k:04d}" for k in range(SHARDS)], opening
    root = tmp_path / "s3"
    publish_weights(RunPaths(root).root, make_model().state_dict(), 0)
    with s3_server.requests.recording(by_key=True) as sent:
        torchrun(3, root, STEPS, "s3-shards", url, env=s3_server.env())
    assert_trains_like(root, one_rank_shards)
    by_rank = [[(method, path) for key, method, path in sent if key == f"rank{r}"] for r in range(3)]
    assert len(_view_requests(by_rank[0])) > len(opening)  # rank 0 refreshed for its draws
    assert sorted(_view_requests(by_rank[0])[:len(opening)]) == opening  # rank 0 opened the buffer
    for rank in (1, 2):
        assert _view_requests(by_rank[rank]) == [], rank
        units = {path.split("/units/")[1].split("/")[0] for method, path in by_rank[rank] if "/units/" in path}
        assert units, rank  # it read its rows itself
    # rank 0 GETs only its own shards' units: its test of the whole draw (single-turn rows?) is answered
    # by the shards' records (storage/zarr/unit_constants.py), not by fetching the other ranks' units
    shards_read = {path.split("/units/")[0].rsplit("/", 1)[-1] for _, path in by_rank[0] if "/units/" in path}
    assert shards_read == {"shard-0000", "shard-0003"}, shards_read


def test_ranks_resuming_over_a_url_buffer_open_it_from_rank_zeros_records(s3_server, one_rank_shards, tmp_path):
    """A 3-rank run over an S3 buffer stopped at its checkpoint of step 2 and resumed by 3 ranks: rank 0
    opens the buffer and checks that the rows the checkpoint saw are still there; ranks 1 and 2 open it
    from the records rank 0 sends, listing nothing and GETting no record, and the run ends as one rank's."""
    url = _s3_sharded_buffer(s3_server)
    root = tmp_path / "s3-resumed"
    publish_weights(RunPaths(root).root, make_model().state_dict(), 0)
    torchrun(3, root, 2, "s3-shards", url, env=s3_server.env())
    assert CheckpointManager(root / "checkpoints").latest_step() == 2
    with s3_server.requests.recording(by_key=True) as sent:
        torchrun(3, root, STEPS, "s3-shards", url, env=s3_server.env())
    assert_trains_like(root, one_rank_shards)
    by_rank = [[(method, path) for key, method, path in sent if key == f"rank{r}"] for r in range(3)]
    # rank 0: the opening (a LIST and a GET of each record), then the checkpoint's check refreshes
    assert sum("list-type=2" in path for _, path in _view_requests(by_rank[0])[:2 * (1 + SHARDS)]) == 2
    for rank in (1, 2):
        assert _view_requests(by_rank[rank]) == [], rank
        assert any("/units/" in path for _, path in by_rank[rank]), rank  # it read its rows itself


def test_fsdp_ranks_train_like_one_and_their_checkpoint_resumes_on_one_ddp_rank(one_rank, two_rank_runs, tmp_path):
    """FSDP2 (every block and the root sharded over 2 gloo ranks) through micro-batching, a filler
    step and an epoch boundary: the 1-rank losses and weights. Its checkpoints hold the whole
    model and optimizer state: the one at step 2 resumes in a plain process to the same end."""
    root = two_rank_runs["fsdp"]
    torch.testing.assert_close(losses(root), losses(one_rank), rtol=1e-4, atol=1e-6)
    reference, trained = final_weights(one_rank), final_weights(root)
    assert trained.keys() == reference.keys()  # whole tensors under the plain model's names
    for key in reference:
        torch.testing.assert_close(trained[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)
    published, _ = load_weights(root)  # what collectors load: the whole model too
    assert all(torch.equal(published[key], trained[key]) for key in reference)

    resumed = tmp_path / "resumed-from-fsdp"
    shutil.copytree(root, resumed)
    checkpoints = CheckpointManager(resumed / "checkpoints")
    checkpoints.latest().unlink()  # back to the checkpoint of step 2
    assert checkpoints.latest_step() == 2
    train(resumed, STEPS)
    torch.testing.assert_close(losses(resumed), losses(one_rank), rtol=1e-4, atol=1e-6)
    for key, value in final_weights(resumed).items():
        torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("mode", ["blow-up", "blow-up-fsdp"])
def test_every_rank_refuses_a_step_whose_weights_are_not_finite_and_the_checkpoint_stays(two_rank_runs, mode):
    """Weights that overflow after step 3 (a learning rate of 1e30, from the run's checkpoint at step 2):
    both ranks refuse that step with the same line (FSDP's shards are gathered to name the parameter),
    none hangs (the ranks went on to their next runs), and nothing of it is published or checkpointed."""
    root = two_rank_runs[mode]
    refusals = [(root / f"refused-rank{rank}.txt").read_text() for rank in range(2)]
    assert refusals[0] == refusals[1]
    assert refusals[0].startswith("learner step 3 refused: the weights after the optimizer step are not finite ('")
    assert refusals[0].endswith("resumes from the checkpoint of step 2")
    assert CheckpointManager(root / "checkpoints").steps() == [2]
    assert latest_version(root) == 2


# ====================================================================== multi-turn trajectories
DONE, TURN_LIMIT = TerminationReason.ENV_DONE, TerminationReason.MAX_TURNS  # MAX_TURNS is masked (the worker's settings)
# (turns of each trajectory, how each ended), appended in this order; the worker reads 8 rows a draw in that order
MULTI_TURN_APPENDS = [
    ([3, 1, 4], [DONE, TURN_LIMIT, DONE]),  # draw 0, rows 0-7: ends 3 trajectories, one of them masked
    ([8], [DONE]),  # draw 1: ends 1, so rank 1 trains a filler
    ([10, 2, 2, 2], [DONE, DONE, TURN_LIMIT, TURN_LIMIT]),  # draw 2 ends none (no step); draw 3 ends 4, rank 1's 2 masked
    ([1] * 8, [DONE] * 4 + [TURN_LIMIT] * 4),  # draw 4: single-turn rows, every row of rank 1's slice masked
    ([1], [DONE]),  # draw 5: the epoch's last row, rank 1 a filler; draw 6 is draw 0 again
]
MULTI_TURN_STEPS = 6


def make_multi_turn_run(root: Path) -> None:
    paths = RunPaths(root)
    store = create_store(paths.buffer, "memmap", schema=StoreSchema(optional=OPTIONAL), segment_rows=8)
    first_id = 0
    for seed, (turns, reasons) in enumerate(MULTI_TURN_APPENDS):
        store.append(multi_turn_rows(turns, seed=seed, first_id=first_id, reasons=reasons))
        first_id += len(turns)
    store.close()
    publish_weights(paths.root, make_model().state_dict(), 0)


@pytest.fixture(scope="module")
def one_rank_multi_turn(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp-turns") / "one-rank"
    make_multi_turn_run(root)
    train(root, MULTI_TURN_STEPS, mode="turns")
    return root


def test_one_rank_trains_the_multi_turn_buffer_as_designed(one_rank_multi_turn):
    """The reference the ranks are held to takes the draws MULTI_TURN_APPENDS describes."""
    records = read_metrics(RunPaths(one_rank_multi_turn).metrics)
    assert [r.get("charts/trajectories") for r in records] == [3, 1, 4, None, None, 3]
    assert [r["charts/trajectories_masked"] for r in records] == [1, 0, 2, 4, 0, 1]
    assert [r["charts/rows"] for r in records] == [2, 1, 2, 4, 1, 2]
    # every turn of a trained trajectory counts as trained; the masked ones do not
    assert [r["charts/rows_trained"] for r in records] == [7, 15, 27, 31, 32, 32]


@pytest.mark.parametrize("mode", ["turns", "turns-fsdp"])
def test_two_ranks_train_multi_turn_trajectories_like_one(one_rank_multi_turn, two_rank_runs, mode):
    """Each rank reads its slice of the draw's trajectories whole; fillers where a rank's slice ends
    none or is masked away, a draw that ends none skipped on every rank: the 1-rank losses, weights
    and counts, under DDP and FSDP."""
    root = two_rank_runs[mode]
    torch.testing.assert_close(losses(root), losses(one_rank_multi_turn), rtol=1e-4, atol=1e-6)
    reference, trained = final_weights(one_rank_multi_turn), final_weights(root)
    for key in reference:
        torch.testing.assert_close(trained[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)
    counts = ("charts/trajectories", "charts/turns_per_trajectory_mean", "charts/rows_deferred_to_trajectory_end",
              "charts/trajectories_incomplete", "charts/trajectories_masked", "charts/rows", "charts/rows_trained",
              "charts/response_length_mean", "charts/reward_mean")
    want, got = (read_metrics(RunPaths(r).metrics) for r in (one_rank_multi_turn, root))
    for key in counts:
        assert [r.get(key) for r in got] == pytest.approx([r.get(key) for r in want]), key


def test_a_two_rank_multi_turn_checkpoint_resumes_on_one_rank(one_rank_multi_turn, two_rank_runs, tmp_path):
    """Narrowing draws to trajectory ends keeps no state of its own: rank 0's checkpoint at step 2
    (after a filler step; a skipped draw lies just ahead) resumes on one rank to the same end."""
    root = tmp_path / "resumed"
    shutil.copytree(two_rank_runs["turns-at-step-2"], root)
    assert CheckpointManager(root / "checkpoints").latest_step() == 2
    train(root, MULTI_TURN_STEPS, mode="turns")
    torch.testing.assert_close(losses(root), losses(one_rank_multi_turn), rtol=1e-4, atol=1e-6)
    reference, resumed = final_weights(one_rank_multi_turn), final_weights(root)
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)
    want, got = (read_metrics(RunPaths(r).metrics) for r in (one_rank_multi_turn, root))
    assert [r["charts/rows_trained"] for r in got] == [r["charts/rows_trained"] for r in want]
