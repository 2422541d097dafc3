"""MetricsWriter: metrics.jsonl is the source of truth, and TensorBoard shows the same numbers."""

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf_pipeline.learn.metrics import MetricsWriter, read_metrics


def read_tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_every_numeric_metric_reaches_tensorboard_at_its_step(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb")
    for step in (1, 2, 3):
        writer.log(step, {"losses/loss": 0.5 / step, "charts/rows": step * 64, "charts/flag": True,
                          "note": "text is kept in the JSONL only"})
    writer.log(4, {"note": "a step with no number writes no event"})
    writer.close()

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    scalars = read_tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == {"losses/loss", "charts/rows", "charts/flag"}
    for record in records[:3]:
        step = record["step"]
        assert math.isclose(scalars["losses/loss"][step], record["losses/loss"], rel_tol=1e-6)
        assert scalars["charts/rows"][step] == record["charts/rows"]
        assert scalars["charts/flag"][step] == 1.0
    assert all(4 not in by_step for by_step in scalars.values())


def test_a_resumed_run_hides_the_steps_a_killed_learner_logged_past_its_checkpoint(tmp_path, monkeypatch):
    """Killed at step 5 with a checkpoint at step 3, a learner had logged steps 4 and 5; resumed, it
    logs them again: TensorBoard shows each step once, as the resumed run logged it."""
    import time
    import types

    from tensorboard.summary.writer import event_file_writer

    # TensorBoard reads a directory's event files in name order: creation second, host, pid, then a
    # per-process counter, which sorts "10" before "9". A killed learner's file is seconds older than its
    # resumed one's in a run; both made by this process in one second, the two counters can cross a digit
    # (as they did once in the whole suite), so the killed writer's file is dated a minute back
    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: time.time() - 60))
    killed = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb")
    monkeypatch.undo()
    for step in range(1, 6):
        killed.log(step, {"losses/loss": float(step)})
    killed.close()
    resumed = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb", resumed_after=3)
    for step in (4, 5, 6):
        resumed.log(step, {"losses/loss": 10.0 * step})
    resumed.close()

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("losses/loss")] == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_every_reader_of_the_log_skips_a_line_a_kill_cut_short(tmp_path, capsys):
    """The learner's reader, `plot`'s and the launcher's summary read one way: the whole records, and
    not the last line of a writer killed mid-write."""
    from rlhf_pipeline.dataio.plots import read_metrics as plotted_metrics
    from rlhf_pipeline.files.run_paths import run_paths
    from rlhf_pipeline.runs.run import print_summary

    paths = run_paths("run", str(tmp_path))
    paths.metrics.parent.mkdir(parents=True)
    writer = MetricsWriter(paths.metrics, paths.tensorboard)
    for step in (1, 2):
        writer.log(step, {"charts/reward_mean": 0.25 * step})
    writer.close()
    with open(paths.metrics, "a", encoding="utf-8") as log:
        log.write('{"step": 3, "charts/rew')

    assert [r["step"] for r in read_metrics(paths.metrics)] == [1, 2]
    assert [r["step"] for r in plotted_metrics(paths.metrics)] == [1, 2]
    print_summary(paths)
    assert "done: 2 learner steps; mean reward 0.250 (first step) -> 0.500 (last step)" in capsys.readouterr().err


def test_a_resume_drops_a_torn_tail_whatever_its_bytes(tmp_path):
    """After a crash a log may end in a cut line, zeros, or bytes that are not UTF-8 (a block the file
    system never wrote): the resume keeps the whole lines up to its checkpoint, and nothing else. Bytes
    not UTF-8 stopped the resumed learner with a UnicodeDecodeError."""
    from rlhf_pipeline.learn.metrics import truncate_metrics

    log = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(log)
    for step in (1, 2, 3):
        writer.log(step, {"losses/loss": float(step)})
    writer.close()
    with open(log, "ab") as f:
        f.write(b'{"step": 4, "losses/lo\xff\xfe' + b"\0" * 64)
    truncate_metrics(log, after_step=2)
    assert [r["step"] for r in read_metrics(log)] == [1, 2]
    assert log.read_bytes().count(b"\n") == 2


def test_a_log_appended_to_after_a_kill_mid_line_keeps_every_whole_record(tmp_path):
    """A collector's log is appended to by its next start, which truncates nothing (the learner's
    resume cuts its own log to the checkpoint). The next record joined the cut line, `{"step": 3{"step": 4,
    ...}`, and was lost with it; the cut line is dropped instead, whatever its bytes, even with no line
    before it."""
    log = tmp_path / "collector" / "metrics-0000.jsonl"
    writer = MetricsWriter(log)
    for step in (1, 2):
        writer.log(step, {"rows": 64.0})
    writer.close()
    for torn, kept in ((b'{"step": 3, "ro\xff', [1, 2, 4]), (b'{"step": 5' + b"\0" * 70_000, [1, 2, 4, 6])):
        with open(log, "ab") as f:
            f.write(torn)
        writer = MetricsWriter(log)  # the collector started again
        writer.log(kept[-1], {"rows": 64.0})
        writer.close()
        assert [r["step"] for r in read_metrics(log)] == kept
        assert log.read_bytes().count(b"\n") == len(kept)
    alone = tmp_path / "alone.jsonl"
    alone.write_bytes(b'{"step": 1, "ro')
    writer = MetricsWriter(alone)
    writer.log(1, {"rows": 64.0})
    writer.close()
    assert [r["step"] for r in read_metrics(alone)] == [1]


def test_a_full_disk_under_the_metrics_log_is_the_os_error_naming_it(small_disk):
    """A write to the open log names no file; the command line names the path in one line (cli/run_cmd.py)."""
    import errno

    import pytest
    from helpers import fill

    writer = MetricsWriter(small_disk / "metrics.jsonl")
    fill(small_disk, leave_bytes=0)
    with pytest.raises(OSError) as failed:
        for step in range(1, 100_000):
            writer.log(step, {"loss": 0.5, "padding": "x" * 200})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(small_disk / "metrics.jsonl")
    with pytest.raises(OSError) as failed:  # what is left in the file's buffer: the same, named too
        writer.close()
    assert failed.value.filename == str(small_disk / "metrics.jsonl")


def test_a_full_disk_under_tensorboard_is_one_os_error_naming_its_directory(tmp_path, small_disk, capfd):
    """TensorBoard writes on a thread of its own, which printed its traceback before the learner's own."""
    import errno

    import pytest
    from helpers import fill

    writer = MetricsWriter(tmp_path / "metrics.jsonl", small_disk / "tensorboard")
    fill(small_disk, leave_bytes=0)
    with pytest.raises(OSError) as failed:
        for step in range(1, 100_000):
            writer.log(step, {f"metric_{i}": float(i) for i in range(50)})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(small_disk / "tensorboard")
    with pytest.raises(OSError) as failed:
        writer.close()
    assert failed.value.filename == str(small_disk / "tensorboard")
    assert "Exception in thread" not in capfd.readouterr().err

