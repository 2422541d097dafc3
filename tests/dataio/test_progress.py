"""The plain lines a long command prints in logs (``dataio/progress.py``): the count, and a rate only
once the work has taken long enough for one to mean something."""

from __future__ import annotations

import io

from rlhf_pipeline.dataio import progress
from rlhf_pipeline.dataio.progress import Progress


def test_a_short_piece_of_work_gives_its_time_not_a_rate(monkeypatch):
    monkeypatch.setattr(progress, "RATE_AFTER_S", 1e9)  # shorter than this, however loaded the machine
    log = io.StringIO()  # not a terminal: plain lines
    work = Progress("convert shard-0000 -> zarr", total=512, stream=log)
    work.update(512)
    work.close()
    line = log.getvalue().strip()
    assert line.startswith("[convert shard-0000 -> zarr] 512/512 rows (in ") and line.endswith(" s)"), line
    assert "rows/s" not in line


def test_a_long_piece_of_work_gives_its_rate(monkeypatch):
    monkeypatch.setattr(progress, "RATE_AFTER_S", 0.0)  # any work is long enough
    log = io.StringIO()
    work = Progress("export", total=3008, stream=log)
    work.update(3008)
    work.close()
    line = log.getvalue().strip()
    assert line.startswith("[export] 3008/3008 rows (") and line.endswith(" rows/s)"), line


def test_a_reporter_times_the_work_from_its_making_not_from_the_first_piece_done(monkeypatch, capsys):
    """A convert of one segment reports once, after all of its work: timed from that report it said
    "1/1 ... (in 0.00 s)"."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    report = progress.progress_reporter("convert shard-0000 -> zarr", "rows")
    now[0] = 107.5  # the one piece of work took 7.5 s
    report(512, 512)
    line = capsys.readouterr().err.strip()
    assert line == "[convert shard-0000 -> zarr] 512/512 rows (68 rows/s)", line
