"""files/settings_history.py: which training settings each stretch of a run's steps was trained with."""

import json

import pytest

from rlhf_pipeline.files.run_store import LocalRunStore
from rlhf_pipeline.files.state_files import StateFileError
from rlhf_pipeline.files.settings_history import HISTORY_KEY, SETTINGS_KEY, record_resume, saved_settings, settings_in_force

STARTED = {"seed": 3, "max_lag": 1, "learner": {"lr": 3e-4, "batch_size": 16, "loss": {"kl_coef": 0.0}}}


def resumed(lr: float, *, batch_size: int = 16, max_lag: int = 1) -> dict:
    return {"seed": 3, "max_lag": max_lag, "learner": {"lr": lr, "batch_size": batch_size, "loss": {"kl_coef": 0.0}}}


def resume(store, settings: dict, step: int) -> None:
    """What a resume from the checkpoint of ``step`` does: reads what is in force there, records its own."""
    record_resume(store, STARTED, settings, step)


def lr_after(store, step: int) -> float:
    return settings_in_force(store, STARTED, step)["learner"]["lr"]


def test_a_run_never_resumed_with_other_settings_keeps_no_history(tmp_path):
    store = LocalRunStore(tmp_path)
    resume(store, STARTED, 4)
    assert not store.exists(HISTORY_KEY)
    assert settings_in_force(store, STARTED, 10) == STARTED


def test_each_step_takes_the_settings_of_the_last_resume_at_or_before_it(tmp_path):
    store = LocalRunStore(tmp_path)
    resume(store, resumed(1e-3), 4)
    resume(store, resumed(1e-3), 6)  # the same as in force at 6: nothing recorded
    resume(store, resumed(2e-3), 8)
    assert [entry["after_step"] for entry in json.loads(store.read(HISTORY_KEY))["entries"]] == [4, 8]
    assert [lr_after(store, step) for step in (0, 3, 4, 7, 8, 20)] == [3e-4, 3e-4, 1e-3, 1e-3, 2e-3, 2e-3]
    # an entry holds what differs from settings.json, the rest of the run's settings stand
    assert settings_in_force(store, STARTED, 8) == {**STARTED, "learner": {**STARTED["learner"], "lr": 2e-3}}


def test_a_resume_from_an_older_checkpoint_supersedes_the_later_ones_it_trained_again(tmp_path):
    """A resume at 8, killed before its first checkpoint, then one from 6 (the newest left): steps after
    6 were all trained again, with the last one's settings."""
    store = LocalRunStore(tmp_path)
    resume(store, resumed(1e-3), 4)
    resume(store, resumed(2e-3), 8)
    resume(store, resumed(5e-4, batch_size=32), 6)
    assert [lr_after(store, step) for step in (5, 6, 9)] == [1e-3, 5e-4, 5e-4]
    assert settings_in_force(store, STARTED, 9)["learner"]["batch_size"] == 32
    assert settings_in_force(store, STARTED, 5)["learner"]["batch_size"] == 16


def test_a_resume_from_before_a_later_entry_is_recorded_even_with_the_settings_in_force_there(tmp_path):
    """Resumed at 8 with another learning rate, then (its checkpoints past 6 deleted) from 6 with the first
    one, which is in force at 6: the steps after 6 were trained again with it, past the entry at 8 too."""
    store = LocalRunStore(tmp_path)
    resume(store, resumed(1e-3), 8)
    resume(store, STARTED, 6)
    assert [lr_after(store, step) for step in (7, 8, 12)] == [3e-4, 3e-4, 3e-4]


def test_a_resume_back_to_the_first_settings_is_recorded_too(tmp_path):
    store = LocalRunStore(tmp_path)
    resume(store, resumed(1e-3, max_lag=0), 4)
    resume(store, STARTED, 8)
    assert settings_in_force(store, STARTED, 6)["max_lag"] == 0
    assert settings_in_force(store, STARTED, 8) == STARTED


def test_a_damaged_history_is_refused_naming_the_file_and_the_way_out(tmp_path):
    store = LocalRunStore(tmp_path)
    store.write(HISTORY_KEY, b'{"format": 1, "entries": [{"after_step": "four"}]}')
    with pytest.raises(StateFileError, match=rf"{HISTORY_KEY} is damaged.*delete it"):
        settings_in_force(store, STARTED, 4)


@pytest.mark.parametrize("run_home", ["s3"], indirect=True)
def test_starts_recording_one_resume_at_once_on_object_storage_record_it_once(run_home):
    """The data-parallel ranks of one start on other machines prepare the run at once, each with a run store
    of its own: a history written by another since one read it is read again, not refused (an object
    store's write is fenced), and the resume is recorded once."""
    from concurrent.futures import ThreadPoolExecutor

    from rlhf_pipeline.files.object_run_store import ObjectRunStore

    stores = [ObjectRunStore(f"{run_home}/ranks") for _ in range(6)]
    with ThreadPoolExecutor(len(stores)) as pool:
        list(pool.map(lambda store: resume(store, resumed(1e-3), 4), stores))  # raises what any raised
    entries = json.loads(stores[0].read(HISTORY_KEY))["entries"]
    assert entries == [{"after_step": 4, "settings": {"learner.lr": 1e-3}}]


def test_the_best_checkpoints_rule_is_the_one_the_latest_start_trains_with(tmp_path):
    """``learner.keep_best`` (which checkpoint ``branch --from-step best``, the evaluator and retention keep)
    is read with the resumes' changes: one set on resume is seen, and its damaged history falls back to
    settings.json."""
    from rlhf_pipeline.learn.keep_best import recorded_keep_best

    store = LocalRunStore(tmp_path)
    started = {**STARTED, "learner": {**STARTED["learner"], "keep_best": None}, "eval": {"every_steps": 2}}
    store.write("settings.json", json.dumps(started).encode())
    assert recorded_keep_best(store) is None
    record_resume(store, started, {**started, "learner": {**started["learner"], "keep_best": "eval/math/pass@1"}}, 4)
    assert recorded_keep_best(store).metric == "eval/math/pass@1"
    store.write(HISTORY_KEY, b"damaged")
    assert recorded_keep_best(store) is None


@pytest.mark.parametrize("damaged", [b'{"seed": 3, ', b"[3]", b"\xff\xfe", b""])
def test_saved_settings_are_the_json_object_a_start_wrote_or_refused_naming_the_file(tmp_path, damaged):
    store = LocalRunStore(tmp_path)
    assert saved_settings(store) is None  # no run made yet
    store.write(SETTINGS_KEY, json.dumps(STARTED).encode())
    assert saved_settings(store) == STARTED
    store.write(SETTINGS_KEY, damaged)
    with pytest.raises(StateFileError, match=rf"{tmp_path / SETTINGS_KEY} is damaged.*restore it from a copy"):
        saved_settings(store)
