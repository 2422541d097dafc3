"""When a collector takes the run's ``STOP`` as its learner's end (``runs/processes._StopCheck``): a real
run directory, ``STOP`` written as a learner writes it, and a real ``StopFlag`` with and without a
launcher's pipe."""

from __future__ import annotations

import os

import pytest

from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.runs.processes import _StopCheck
from rlhf_pipeline.runs.stopping import StopFlag


@pytest.fixture
def flag(request, monkeypatch):
    """A collector's StopFlag: started by a launcher (its pipe open, as `run` and the Ray driver give it)
    or on its own (`collect`)."""
    read_end = write_end = None
    if request.param == "launched":
        read_end, write_end = os.pipe()
        monkeypatch.setattr(StopFlag, "launcher_fd", read_end)
    stop = StopFlag("collector")
    yield stop
    stop.restore()
    if write_end is not None:
        stop.event.set()  # already stopping: its watcher ends without a line
        os.write(write_end, b"s")  # ends its watcher thread as a launcher's stop request does
        os.close(write_end)


@pytest.mark.parametrize("flag", ["on its own"], indirect=True)
def test_a_collector_on_its_own_takes_a_stop_found_at_its_start_as_an_earlier_learners(flag, tmp_path, capsys):
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.request_stop()  # the learner that finished before this collector started
    check = _StopCheck(paths, flag, "[collector]")
    assert "finished before this collector started" in capsys.readouterr().err
    assert not check()
    # a paced wait says what it waits for: not "the learner's last step", which was that finished learner's
    assert check.waiting_for.startswith("waiting for the next learner (`learn` or `run` with a larger --steps)")
    paths.clear_stop()  # the next learner starts
    assert not check()
    assert check.waiting_for is None  # the pacing's reasons speak of that learner
    paths.request_stop()  # and finishes
    assert check()


@pytest.mark.parametrize("flag", ["on its own"], indirect=True)
def test_a_new_learners_stop_ends_it_even_when_its_start_was_not_seen(flag, tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.request_stop()
    check = _StopCheck(paths, flag, "[collector]")
    paths.clear_stop()
    paths.request_stop()  # cleared and written again between two looks: another token
    assert check()


@pytest.mark.parametrize("flag", ["launched"], indirect=True)
def test_a_collector_of_a_launcher_stops_at_a_stop_found_at_its_start(flag, tmp_path, capsys):
    """The launcher cleared STOP before starting it: one there was written by this run's learner (a
    collector restarted after the learner's end, as Ray restarts a killed actor)."""
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.request_stop()
    check = _StopCheck(paths, flag, "[collector]")
    assert check()
    assert "finished before this collector started" not in capsys.readouterr().err
    assert check.waiting_for is None
