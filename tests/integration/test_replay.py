"""``rlhf-pipeline replay`` end to end: a recorded buffer trains new runs, deterministically,
resumably after ``kill -9``, row for row comparable, with re-scoring, and never modified.

The recorded buffer is synthetic (tokens of the default pipeline's character vocabulary),
written once per module; every replay trains the default pipeline's tiny model on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import kill_when
import preloaded

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.runs.replay import ReplayError, ReplayOptions, replay_command
from rlhf_pipeline.runs.lineage import run_store_at
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_store
from rlhf_pipeline.storage.convert import convert
from rlhf_pipeline.storage.sharded import shard_path
from rlhf_pipeline.schema.synthetic import synthetic_batch
from rlhf_pipeline.coordination.weights import latest_version, load_weights

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
VOCAB = len(char_tokenizer())
ROWS = 96  # 6 batches of 16 per epoch
SMALL = ["warm_start_steps=0", "hidden_size=32", "num_layers=1", "num_heads=2", "learner.batch_size=16",
         "learner.checkpoint_every=2", "learner.log_every=100", "learner.publish_every=1"]
SMALL_CLI = [arg for item in SMALL for arg in ("--set", item)]


def recorded_rows(n: int, *, seed: int = 0, optional=("advantage",), high_bits: int = 0):
    rows = synthetic_batch(n, group_size=4, prompt_len=(3, 8), response_len=(1, 6), seed=seed,
                           optional_fields=optional, vocab_size=VOCAB)
    ids = torch.arange(n, dtype=torch.int64) + high_bits
    return rows.with_columns(policy_version=torch.arange(n) // 24, trajectory_id=ids,
                             group_id=(torch.arange(n) // 4) + high_bits)


def record(path: Path, rows, backend: str = "memmap") -> Path:
    store = create_store(path, backend, schema=StoreSchema.for_batch(rows), segment_rows=32)
    store.append(rows)
    store.close()
    return path


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` by its bytes (and every directory, by name)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def losses(run: Path) -> list[float]:
    return [r["losses/loss"] for r in read_metrics(run / "metrics.jsonl")]


def batches(run: Path) -> list[list[int]]:
    return [r["trajectory_ids"] for r in read_metrics(run / "batches.jsonl")]


def same_weights(a: Path, b: Path) -> bool:
    wa, _ = load_weights(a)
    wb, _ = load_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def replay(home: Path, name: str, buffer, *extra: str, **options) -> Path:
    replay_command(DEFAULT, ReplayOptions(buffer=str(buffer), **options), home=str(home), run_name=name,
                   overrides=SMALL + list(extra))
    return home / name


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("recorded") / "buffer", recorded_rows(ROWS))


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def reference_run(home, source) -> Path:
    """Three epochs of the recorded buffer; the source's bytes are checked before and after."""
    before = digest(source)
    run = replay(home, "reference", source, epochs=3, seed=7)
    assert digest(source) == before
    return run


def test_a_replay_walks_every_row_per_epoch_and_records_what_it_did(reference_run, source):
    assert [r["step"] for r in read_metrics(reference_run / "metrics.jsonl")] == list(range(1, 19))
    steps = batches(reference_run)
    for epoch in range(3):
        ids = [i for batch in steps[6 * epoch: 6 * epoch + 6] for i in batch]
        assert sorted(ids) == list(range(ROWS))  # every row once per epoch
    assert steps[0] != steps[6]  # reshuffled each epoch
    metrics = read_metrics(reference_run / "metrics.jsonl")
    # off-policy by construction: the ratio to the stored sampling log-probs, and the versions of the rows
    assert {"losses/ratio_mean", "losses/ratio_min", "losses/ratio_max", "losses/clip_frac_low",
            "losses/approx_kl_old", "charts/row_version_min", "charts/row_version_spread"} <= set(metrics[0])
    assert max(m["charts/row_version_spread"] for m in metrics) > 0
    settings = json.loads((reference_run / "settings.json").read_text())
    replayed = settings["replay"]
    assert replayed["buffer"] == str(source) and replayed["rows"] == ROWS and replayed["backend"] == "memmap"
    assert replayed["order"] == "shuffle" and replayed["seed"] == 7 and replayed["epochs"] == 3
    assert replayed["learner"]["sampler"] == "epoch" and replayed["learner"]["max_staleness"] is None
    assert replayed["staleness_bound"].startswith("none")
    assert settings["hidden_size"] == 32  # the pipeline's own settings sit beside it


def test_a_replay_writes_no_pacing_file(reference_run):
    # pacing.json tells collectors what the learner took in; a replay has none, so its 18 steps
    # write none (it was rewritten every step: at a URL, a PUT per step for no reader)
    assert (reference_run / "checkpoints").is_dir()
    assert not (reference_run / "pacing.json").exists()


def test_the_same_seed_gives_the_same_losses_and_weights(home, source, reference_run):
    again = replay(home, "again", source, epochs=3, seed=7)
    assert losses(again) == losses(reference_run)
    assert same_weights(again, reference_run)
    other_seed = replay(home, "other-seed", source, steps=2, seed=8)
    assert batches(other_seed) != batches(reference_run)[:2]


def test_algorithms_compared_on_identical_data(home, source, reference_run):
    """Loss settings change the losses, not the rows of any step."""
    variant = replay(home, "dapo-seqmean", source, "learner.loss.clip_eps_high=0.28",
                     "learner.loss.aggregation=sequence_mean", epochs=3, seed=7)
    assert batches(variant) == batches(reference_run)
    assert losses(variant) != losses(reference_run)


def test_a_replay_killed_with_sigkill_resumes_to_the_same_losses_and_weights(home, source, reference_run, capfd):
    """The replay killed is a process of its own; the same command resumes it in this process (a process
    of its own would import torch again)."""
    from rlhf_pipeline.cli.main import main

    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", str(source),
               "--epochs", "3", "--seed", "7", "--home", str(home), "--run-name", "killed", *SMALL_CLI]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the in-process reference ran on one thread
    run = home / "killed"
    first = preloaded.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    metrics = run / "metrics.jsonl"
    # whole lines only: the replay may be writing the next one
    err = kill_when(first, lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, timeout=240,
                    poll_s=0.01, wait_s=60)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    stopped_at = len(read_metrics(run / "metrics.jsonl"))
    assert 3 <= stopped_at < 18, "the kill came after the replay had finished; nothing was resumed"

    capfd.readouterr()
    assert main(command[3:]) == 0
    assert "resuming from" in capfd.readouterr().err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 19))
    assert losses(run) == losses(reference_run)
    assert batches(run) == batches(reference_run)
    assert same_weights(run, reference_run)


def test_init_from_a_run_or_a_save_pretrained_directory(home, source, reference_run, tmp_path):
    from_run = replay(home, "from-run", source, steps=1, init_from=str(reference_run))
    newest, _ = load_weights(reference_run)
    start, version = load_weights(from_run, 0)
    assert version == 0 and all(torch.equal(start[k], newest[k]) for k in newest)

    tokenizer = char_tokenizer()
    model = tiny_causal_lm(VOCAB, hidden_size=32, num_layers=1, num_heads=2, seed=11,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path / "hf")
    from_dir = replay(home, "from-dir", source, steps=1, init_from=str(tmp_path / "hf"))
    start, _ = load_weights(from_dir, 0)
    assert all(torch.equal(start[k], v) for k, v in model.state_dict().items())

    wider = tiny_causal_lm(VOCAB, hidden_size=64, num_layers=1, num_heads=2, seed=11)
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(ReplayError, match=r"do not fit the pipeline's model .*shape mismatches.*--set hidden_size"):
        replay(home, "from-wider", source, steps=1, init_from=str(tmp_path / "wider"))
    # a replay that could not start leaves nothing behind, not even its locks: the fixed command just runs,
    # and no directory of locks is listed among the runs
    assert not (home / "from-wider").exists()
    with pytest.raises(ReplayError, match="neither a run directory .* nor a model directory"):
        replay(home, "from-nothing", source, steps=1, init_from=str(tmp_path))
    assert not (home / "from-nothing").exists()


def test_zarr_zip_url_and_sharded_sources(home, source, tmp_path):
    convert(str(source), str(tmp_path / "zarr"), "zarr")
    archive = tmp_path / "buffer.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for file in sorted((tmp_path / "zarr").rglob("*")):
            if file.is_file() and file.name != "writer.lock":
                zf.write(file, file.relative_to(tmp_path / "zarr").as_posix())
    memmap_order = replay(home, "src-memmap", source, steps=3, order="sequential")
    for name, location in (("src-zip", archive), ("src-url", (tmp_path / "zarr").as_uri())):
        run = replay(home, name, location, steps=3, order="sequential")
        assert batches(run) == batches(memmap_order) and losses(run) == losses(memmap_order)

    for k in range(2):  # a run's buffer/ of two collectors' shards
        record(shard_path(tmp_path / "run" / "buffer", k), recorded_rows(32, seed=k, high_bits=k << 40))
    before = digest(tmp_path / "run")
    sharded = replay(home, "src-shards", tmp_path / "run" / "buffer", epochs=1)
    ids = [i for batch in batches(sharded) for i in batch]
    assert len(ids) == 64 and {i >> 40 for i in ids} == {0, 1} and len(set(ids)) == 64
    assert digest(tmp_path / "run") == before
    # a collector adds rows to the first shard: the second shard's positions move, so no resume
    with open_store(shard_path(tmp_path / "run" / "buffer", 0), mode="a") as shard:
        shard.append(recorded_rows(4, seed=9, high_bits=5 << 40))
    with pytest.raises(ReplayError, match="gained 4 rows since this replay started; in a buffer of shards"):
        replay(home, "src-shards", tmp_path / "run" / "buffer", epochs=2)


def test_rescoring_a_buffer_recorded_without_advantages_or_reference(home, reference_run, tmp_path):
    bare = record(tmp_path / "bare", recorded_rows(ROWS, optional=()))
    with pytest.raises(ReplayError, match="stores no 'advantage' field.*--advantage-baseline mean"):
        replay(home, "bare", bare, steps=2)
    with pytest.raises(ReplayError, match="kl_coef=0.1 needs reference log-probs.*--ref-model"):
        replay(home, "bare", bare, "learner.loss.kl_coef=0.1", steps=2, advantage_std=False)
    # a --ref-model that is no model is refused before the run directory is written (it was found while
    # training, and the settings.json left behind refused the corrected command: "other settings")
    with pytest.raises(ReplayError, match="--ref-model .* is neither a run directory .* nor a model directory"):
        replay(home, "bare", bare, "learner.loss.kl_coef=0.1", steps=2, advantage_std=False,
               advantage_baseline="leave-one-out", ref_model=str(tmp_path))
    assert not (home / "bare" / "settings.json").exists() and latest_version(home / "bare") is None
    before = digest(bare)
    run = replay(home, "bare", bare, "learner.loss.kl_coef=0.1", steps=2, advantage_std=False,
                 advantage_baseline="leave-one-out", ref_model=str(reference_run))
    assert digest(bare) == before
    metrics = read_metrics(run / "metrics.jsonl")
    assert len(metrics) == 2
    assert all(m["losses/kl"] > 0 and m["charts/sampler_ref_kl_mean"] != 0 for m in metrics)
    assert json.loads((run / "settings.json").read_text())["replay"]["advantage_baseline"] == "leave-one-out"


def test_a_source_without_rows_is_refused_naming_it_and_nothing_is_made(home, source, tmp_path):
    """A filter that kept nothing, or a store made before any row: refused by what it lacks (it was refused by
    learner.epoch_rows=0, a setting the user never set), before the run directory is made."""
    from rlhf_pipeline.storage.filtering import filter_buffer

    empty_selection = tmp_path / "kept-nothing"
    filter_buffer(source, empty_selection, "reward > 2", selection=True)
    empty_store = create_store(tmp_path / "empty", "zarr", schema=StoreSchema.for_batch(recorded_rows(4)))
    empty_store.close()
    for empty in (empty_selection, tmp_path / "empty"):
        with pytest.raises(ReplayError, match=f"--buffer {empty}: .* holds no rows, so there is nothing to replay"):
            replay(home, "from-no-rows", empty, steps=2)
        assert not (home / "from-no-rows").exists()


def test_rows_of_another_tokenizer_are_refused_before_the_run_directory_is_made(home, source, tmp_path):
    """A buffer whose token ids the pipeline's model cannot embed (a run of another pipeline, replayed with
    this one): the first step died with an IndexError in the embedding, and the replay directory it left
    refused the corrected command as "started with other settings". Now refused naming a row, its id and
    the vocabulary, with nothing made; the corrected command under the same name then runs."""
    foreign = synthetic_batch(32, group_size=4, prompt_len=(3, 8), response_len=(1, 6), seed=3,
                              optional_fields=("advantage",), vocab_size=4 * VOCAB)
    assert int(foreign["response_tokens"].values.max()) >= VOCAB  # ids this model has no embedding for
    buffer = record(tmp_path / "foreign", foreign)
    with pytest.raises(ReplayError, match=rf"--buffer {buffer}: trajectory \d+ \(group \d+\) holds token id \d+ "
                                          rf"in \w+_tokens, outside this pipeline's model's vocabulary of {VOCAB}"):
        replay(home, "from-another-tokenizer", buffer, steps=1)
    assert not (home / "from-another-tokenizer").exists()
    run = replay(home, "from-another-tokenizer", source, steps=1)
    assert len(losses(run)) == 1


def test_a_resumed_replay_must_match_how_it_started(home, source, reference_run):
    with pytest.raises(ReplayError, match=r"other settings \(--order: was 'shuffle', now 'sequential'\)"):
        replay(home, "reference", source, epochs=3, seed=7, order="sequential")
    with pytest.raises(ReplayError, match="not a replay; choose another --run-name"):
        (home / "online").mkdir()
        (home / "online" / "settings.json").write_text(json.dumps({"steps": 3}))
        replay(home, "online", source, steps=1)
    with pytest.raises(ReplayError, match="does not exist"):
        replay(home, "missing", home / "no-such-buffer", steps=1)
    # more epochs on a finished replay: it goes on from its last checkpoint
    replay(home, "extended", source, epochs=1, seed=7)
    longer = replay(home, "extended", source, epochs=2, seed=7)
    assert batches(longer)[:6] == batches(reference_run)[:6] and len(losses(longer)) == 12
    assert sorted(i for batch in batches(longer)[6:] for i in batch) == list(range(ROWS))


def test_the_shuffle_window_is_fitted_to_a_zarr_readers_cache(source, tmp_path, capsys):
    from rlhf_pipeline.learn.settings import LearnerSettings
    from rlhf_pipeline.runs.replay import fit_shuffle_window
    from rlhf_pipeline.storage import open_buffer

    convert(str(source), str(tmp_path / "zarr"), "zarr")
    settings = LearnerSettings(sampler="epoch", max_staleness=None, shuffle_window_rows=64)
    with open_buffer(tmp_path / "zarr") as store:
        row_bytes = store.stats().raw_bytes / ROWS
        cache = int(row_bytes * 41)  # half of it holds 20.5 rows
        fitted = fit_shuffle_window(store, ROWS, settings, given=None, cache_bytes=cache)
        assert fitted.shuffle_window_rows == 20 and "shuffle window set to 20 rows" in capsys.readouterr().err
        given = fit_shuffle_window(store, ROWS, settings, given=64, cache_bytes=cache)
        assert given.shuffle_window_rows == 64 and "use --shuffle-window 20" in capsys.readouterr().err
        assert fit_shuffle_window(store, ROWS, settings, given=None, cache_bytes=cache * 10) is settings
    with open_buffer(source) as memmap:  # a memmap reader has no such cache: nothing to fit
        assert fit_shuffle_window(memmap, ROWS, settings, given=None, cache_bytes=cache) is settings


def test_the_ranks_of_a_replay_killed_with_sigkill_stop_and_it_resumes_to_the_same_rows(home, source,
                                                                                       reference_run, capfd):
    """``--set learner.world_size=2`` starts two data-parallel ranks. ``kill -9`` of their launcher: the
    ranks see the end of its stop pipe, checkpoint at one step and exit, which frees the run directory.
    The same command, in this process (the ranks are processes of their own whoever starts them),
    resumes: every step trains the rows of the uninterrupted replay of one rank (``reference_run``: the
    same epochs and seed), to the same losses and weights within float tolerance."""
    from helpers import process_running, run_child_pids

    from rlhf_pipeline.learn.checkpoint import run_checkpoints
    from rlhf_pipeline.pipeline import RunPaths
    from rlhf_pipeline.runs.run_directory import hold_run_directory

    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", str(source),
               "--epochs", "3", "--seed", "7", "--home", str(home), "--run-name", "killed-ranks", *SMALL_CLI,
               "--set", "learner.world_size=2"]
    run = home / "killed-ranks"
    launcher = preloaded.Popen(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []

    def trained_two_steps() -> bool:  # the ranks' pids are read while their launcher still runs
        if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2:
            ranks.extend(pid for role in ("replay", "replay-1") for pid in run_child_pids(role, str(home), "killed-ranks")
                         if pid != launcher.pid)
            return True
        return False

    err = kill_when(launcher, trained_two_steps, timeout=300, poll_s=0.01, wait_s=240)
    assert launcher.returncode == -signal.SIGKILL and len(ranks) == 2, (ranks, err[-3000:])
    deadline = time.monotonic() + 240
    while any(process_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(process_running(pid) for pid in ranks), "the ranks of a killed replay kept running"
    assert "[learner] the launcher is gone; stopping cleanly" in err, err[-3000:]
    stopped_at = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert 2 <= stopped_at < 18, f"the ranks trained on to step {stopped_at}: they never learned of the kill"
    assert run_checkpoints(RunPaths(run)).latest_step() == stopped_at  # saved at the stop
    with hold_run_directory(RunPaths(run), "replay"):  # free again: the ranks held it for their launcher
        pass

    capfd.readouterr()
    with pytest.MonkeyPatch.context() as ranks_env:
        ranks_env.setenv("OMP_NUM_THREADS", "1")  # the ranks' environment, as the killed start's
        assert replay_command(DEFAULT, ReplayOptions(buffer=str(source), epochs=3, seed=7), home=str(home),
                              run_name="killed-ranks", overrides=[*SMALL, "learner.world_size=2"]) == 0
    done = capfd.readouterr().err  # the ranks write to this process's stderr
    assert "resuming from" in done and done.count("[replay] done") == 1, done[-4000:]  # rank 0 alone talks
    assert done.count(f"[replay] {source}: ") == 1, done[-4000:]  # what the replay does: its launcher says it
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 19))
    assert batches(run) == batches(reference_run)
    # two ranks train as one (to float tolerance: the gradients are summed over ranks)
    torch.testing.assert_close(losses(run), losses(reference_run), rtol=1e-4, atol=1e-6)
    (expected, _), (trained, _) = load_weights(reference_run), load_weights(run)
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_replay_keeps_its_pipeline_file_so_export_model_rebuilds_it(home, reference_run, tmp_path):
    from rlhf_pipeline.cli.main import main

    assert (reference_run / "pipeline.py").read_bytes() == Path(DEFAULT).read_bytes()
    assert main(["export-model", str(reference_run), str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "config.json").is_file()


def test_a_replays_warm_start_and_steps_use_the_pipelines_threads(home, source):
    """As under `run`: the pipeline's `threads` setting, not torch's default of one per core."""
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        replay(home, "threads", source, "threads=2", "warm_start_steps=1", steps=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_a_replay_starts_from_the_recording_runs_initial_policy_or_says_why_it_builds_one(tmp_path, capsys):
    """A buffer recorded by `collect` alone: its run still holds weights version 0, the policy the
    replay's make_policy() would build again (a warm start of minutes in a real pipeline). Reused
    when the settings are the recording's; otherwise the warm start runs and one line says why."""
    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.coordination.weights import weights_path

    settings = [*SMALL, "warm_start_steps=3", "prompts_per_round=2", "group_size=4", "learner.batch_size=8",
                "max_lag=none"]  # collect alone: no learner to pace it
    cli = [arg for item in settings for arg in ("--set", item)]
    assert main(["collect", DEFAULT, "--home", str(tmp_path), "--run-name", "rec", *cli, "--steps", "2"]) == 0
    buffer = tmp_path / "rec" / "buffer"
    capsys.readouterr()

    def replay_said(name: str, *extra: str) -> str:
        replay_command(DEFAULT, ReplayOptions(buffer=str(buffer), steps=1), home=str(tmp_path), run_name=name,
                       overrides=settings + list(extra))
        said = capsys.readouterr()
        return said.out + said.err

    said = replay_said("same")
    assert f"[replay] initial policy: weights version 0 of {tmp_path / 'rec'}, the run that recorded" in said, said
    assert "warm start" not in said

    # the run itself, by its directory or by its name under --home, stands for its buffer
    for name, given in (("by-directory", str(tmp_path / "rec")), ("by-name", "rec")):
        assert main(["replay", DEFAULT, "--buffer", given, "--steps", "1", "--home", str(tmp_path), "--run-name", name,
                     *cli]) == 0
        said = capsys.readouterr().err
        assert f"is a run: its buffer {buffer}" in said and "warm start" not in said, said
        assert json.loads((tmp_path / name / "settings.json").read_text())["replay"]["buffer"] == str(buffer)
        assert batches(tmp_path / name) == batches(tmp_path / "same")
    assert main(["replay", DEFAULT, "--buffer", str(tmp_path / "same"), "--steps", "1", "--home", str(tmp_path),
                 "--run-name", "of-a-replay", *cli]) == 2
    assert f"is a replay of {buffer}, which keeps no buffer of its own" in capsys.readouterr().err
    assert not (tmp_path / "of-a-replay").exists()

    said = replay_said("other", "warm_start_steps=4")
    assert ("[replay] initial policy: the pipeline's make_policy(), since " f"{tmp_path / 'rec'}, which recorded the "
            "buffer, was made with other settings (warm_start_steps)") in said, said
    assert "[run] warm start: 4 steps" in said

    weights_path(tmp_path / "rec", 0).unlink()  # as a run's first checkpoint prunes it
    said = replay_said("pruned")
    assert "no longer holds its weights version 0" in said and "[run] warm start: 3 steps" in said, said


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_replay_of_a_buffer_recorded_at_a_url_starts_from_that_runs_initial_policy(run_home, tmp_path, capsys):
    """As in a directory: the recording run at the URL still holds weights version 0, taken in place of
    a warm start, whether the run, its buffer or a shard of it is given. It was looked for in
    directories only ("no run directory's buffer/"), and the warm start ran."""
    from rlhf_pipeline.cli.main import main

    settings = [*SMALL, "warm_start_steps=3", "prompts_per_round=2", "group_size=4", "learner.batch_size=8",
                "max_lag=none"]
    cli = [arg for item in settings for arg in ("--set", item)]
    assert main(["collect", DEFAULT, "--home", run_home, "--run-name", "rec", *cli, "--steps", "2"]) == 0
    run = f"{run_home}/rec"
    (shard,) = [name for name in run_store_at(run).list("buffer") if "shard-" in name]
    capsys.readouterr()
    for name, given in (("by-run", run), ("by-buffer", f"{run}/buffer"), ("by-shard", f"{run}/buffer/{shard}")):
        assert main(["replay", DEFAULT, "--buffer", given, "--steps", "1", "--home", str(tmp_path), "--run-name", name,
                     *cli]) == 0
        said = capsys.readouterr().err
        assert f"[replay] initial policy: weights version 0 of {run}, the run that recorded" in said, said
        assert "warm start" not in said, said


# ============================================================ a replay at a URL
EPOCHS_CLI = ["--epochs", "2", "--seed", "7"]  # 12 steps of 16 rows; checkpoints every 2 steps
EPOCHS = {"epochs": 2, "seed": 7}  # the same, as ReplayOptions for a replay in this process


@pytest.fixture()
def url_source(run_home) -> str:
    """The recorded buffer as a Zarr store beside the runs (a replay's buffer may be a URL too)."""
    location = f"{run_home.rsplit('/', 1)[0]}/recorded"
    record(location, recorded_rows(ROWS), backend="zarr")
    return location


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_replay_at_a_url_keeps_its_state_there_and_trains_as_in_a_directory(run_home, url_source, tmp_path,
                                                                              monkeypatch, capsys):
    """``replay --home s3://...``: local disk only a cache; it trains exactly as the same replay in a
    local directory, from a source at a URL; a run at a URL is a replay's starting weights; the same
    command again trains nothing, and a changed option is refused, naming it."""
    from integration.run_location import logged, same_weights, trained

    from rlhf_pipeline.cli.main import main
    from rlhf_pipeline.runs.lineage import run_store_at

    home, source = run_home, url_source
    at_url = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", source,
                             "--home", home, "--run-name", "r1", *SMALL_CLI, *EPOCHS_CLI], cwd=tmp_path,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert at_url.returncode == 0, at_url.stderr[-3000:]
    assert f"steps (2 epochs, order shuffle) into {home}/r1" in at_url.stderr
    store = run_store_at(f"{home}/r1")
    keys = set(store.walk())
    for key in ("settings.json", "pipeline.py", "weights/policy_00000012.safetensors", "checkpoints/step_00000012.pt",
                "metrics.jsonl.parts/00000000.jsonl", "batches.jsonl.parts/00000000.jsonl"):
        assert key in keys, sorted(keys)
    assert "run.lock" not in keys and not any(k.endswith(".partial") for k in keys)
    assert "pacing.json" not in keys  # no collectors read it: no PUT of it per step
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # no s3: directory beside the command
    assert b'"buffer": "' + source.encode() + b'"' in store.read("settings.json")
    assert json.loads(store.read("settings.json"))["buffer_backend"] == "zarr"  # as a run at a URL records it

    # the same replay in a local directory, in this process (its CLI start would only import torch again)
    replay_command(DEFAULT, ReplayOptions(buffer=source, **EPOCHS), home=str(tmp_path / "local"),
                   run_name="r1", overrides=SMALL)
    local_run = str(tmp_path / "local" / "r1")
    assert trained(logged(f"{home}/r1")) == trained(logged(local_run))
    assert [r["trajectory_ids"] for r in logged(f"{home}/r1", "batches.jsonl")] == \
        [r["trajectory_ids"] for r in logged(local_run, "batches.jsonl")]
    assert same_weights(f"{home}/r1", local_run)

    # a run at a URL as starting weights (in this process: one step is enough to start from them)
    replay_command(DEFAULT, ReplayOptions(buffer=source, init_from=f"{home}/r1", steps=1), home=str(tmp_path / "local"),
                   run_name="from-url", overrides=SMALL)
    (start, version), (newest, _) = load_weights(tmp_path / "local" / "from-url", 0), load_weights(store)
    assert version == 0 and all(torch.equal(start[k], newest[k]) for k in newest)

    # the same command again: finished, nothing retrained; a changed option is refused, naming it
    # (in this process: the refusal comes before any training)
    monkeypatch.chdir(tmp_path)
    assert main(["replay", DEFAULT, "--buffer", source, "--home", home, "--run-name", "r1", *SMALL_CLI, *EPOCHS_CLI,
                 "--order", "sequential"]) == 2
    refused = capsys.readouterr().err
    assert "--order: was 'shuffle', now 'sequential'" in refused, refused[-3000:]
    assert f"{home}/r1 holds a replay started with other settings" in refused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "local"]  # no s3: directory


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_a_replay_killed_at_a_url_resumes_to_the_same_losses_rows_and_weights(run_home, url_source, tmp_path,
                                                                              monkeypatch):
    """The kill lands after a checkpoint of step 2 or later and before the last; the same command
    resumes from the newest checkpoint at the URL. (In a directory: the test above, killed by its
    metrics lines.)"""
    from integration.run_location import logged, same_weights, trained

    from rlhf_pipeline.runs.lineage import run_store_at

    home, source = run_home, url_source
    run = f"{home}/killed"
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "replay", DEFAULT, "--buffer", source,
               "--home", home, "--run-name", "killed", *SMALL_CLI, *EPOCHS_CLI]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the uninterrupted replay runs in this process, on one thread
    first = preloaded.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    store = run_store_at(run)
    # a checkpoint at step 2 or later, and the run not finished (10 steps of margin to the end)
    err = kill_when(first, lambda: any(n.startswith("step_") and 2 <= int(n[5:13]) < 12
                                       for n in store.list("checkpoints")), wait_s=60)
    assert first.returncode == -signal.SIGKILL, err[-3000:]
    assert "checkpoints/step_00000012.pt" not in store.walk(), "the kill came after the replay had finished"

    resumed = preloaded.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[learner] resuming from {run}/checkpoints/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert [r["step"] for r in logged(run)] == list(range(1, 13))  # every step once, in order
    assert [r["step"] for r in logged(run, "batches.jsonl")] == list(range(1, 13))

    # the uninterrupted replay to compare with, in this process (from tmp_path, whose listing is checked
    # below): its CLI start would only import torch again
    monkeypatch.chdir(tmp_path)
    replay_command(DEFAULT, ReplayOptions(buffer=source, **EPOCHS), home=home, run_name="plain", overrides=SMALL)
    # every chart the same, the versions' numbers too: a replay killed after publishing versions past its
    # checkpoint publishes them again under the same numbers; the losses, the rows of every step and the
    # weights are the same
    pairs = zip(trained(logged(run)), trained(logged(f"{home}/plain")), strict=True)
    for step, (a, b) in enumerate(pairs, start=1):
        assert a == b, f"step {step}: {sorted(set(a.items()) ^ set(b.items()))}"
    assert logged(run, "batches.jsonl") != [] and \
        [r["trajectory_ids"] for r in logged(run, "batches.jsonl")] == \
        [r["trajectory_ids"] for r in logged(f"{home}/plain", "batches.jsonl")]
    assert same_weights(run, f"{home}/plain")
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_a_replay_home_or_init_from_with_an_unsupported_scheme_is_refused(source, tmp_path, monkeypatch, capsys):
    """In this process: each refusal comes before any training, and a CLI start costs seconds."""
    from rlhf_pipeline.cli.main import main

    monkeypatch.chdir(tmp_path)
    base = ["replay", DEFAULT, *SMALL_CLI, "--steps", "1"]
    assert main([*base, "--buffer", str(source), "--home", "gs://bucket/runs", "--run-name", "r"]) == 2
    assert "--home 'gs://bucket/runs' is a URL with a scheme a run cannot live at yet" in capsys.readouterr().err
    home = str(tmp_path / "home")
    assert main([*base, "--buffer", str(source), "--home", home, "--run-name", "r", "--init-from",
                 "ftp://host/run"]) == 2
    assert "--init-from: RUN 'ftp://host/run' is a URL with a scheme a run cannot live at" in capsys.readouterr().err
    assert main([*base, "--buffer", "foo://bucket/buffer", "--home", home, "--run-name", "r"]) == 2
    assert "foo:// is not a URL scheme a buffer can be read at" in capsys.readouterr().err
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))  # no URL taken for a local path
    assert not (tmp_path / "home" / "r" / "settings.json").exists()
