"""Which training settings each stretch of a run's steps was trained with. ``settings.json`` keeps the
first start's; a resume may change ``learner.*`` and ``max_lag``, and records them here
(``settings_history.json``) with the checkpoint step it trains on from. Each entry holds every training
setting that differs from ``settings.json`` then: a resume from an older checkpoint than an earlier
one's trained the steps after it again, so the entry appended last among those at or before a step is
the one in force there. A branch continues with those of its step. Design: docs/pipelines.md#resume."""

from __future__ import annotations

import copy
import json
from typing import Any

from rlhf_pipeline.files.atomic import json_object
from rlhf_pipeline.files.run_store import StaleWriterError
from rlhf_pipeline.files.state_files import StateFileError

SETTINGS_KEY = "settings.json"
HISTORY_KEY = "settings_history.json"
HISTORY_FORMAT = 1
NEWEST = 2**62  # a step past every step: what the latest start trains with


def trains_with(key: str) -> bool:
    """Whether the dotted setting ``key`` changes how steps are trained and a resume may change it."""
    return key.startswith("learner.") or key == "max_lag"


def saved_settings(store: Any) -> dict[str, Any] | None:
    """The run's ``settings.json`` (in ``store``); None when it has none. A file that is not a JSON object
    (damaged, or edited by hand) is refused, naming it: a resume, a branch or an eval reading it could only
    guess the settings the run was made with."""
    raw = store.read(SETTINGS_KEY)
    if raw is None:
        return None
    settings = json_object(raw)
    if settings is None:
        raise StateFileError(f"{store.describe(SETTINGS_KEY)} is damaged (not the settings JSON this library writes); "
                             f"restore it from a copy, or delete it: the next start records the settings it is given "
                             f"(and cannot check them against those the run was made with)")
    return settings


def settings_in_force(store: Any, saved: dict[str, Any], step: int) -> dict[str, Any]:
    """``saved`` (a run's ``settings.json``) with the training settings the steps after ``step`` were
    trained with, as the run's history (in ``store``) records them."""
    return _in_force(saved, history_entries(store), step)


def record_resume(store: Any, saved: dict[str, Any], settings_json: dict[str, Any], step: int) -> None:
    """Appends the training settings of ``settings_json`` (a resume's, as JSON) to the history when they
    are not those in force at ``step``, the checkpoint step it trains on from (0: from the start), or when
    an entry is past ``step`` (its newer checkpoints are gone: this start trains those steps again). An
    entry holds those that differ from ``saved`` (``settings.json``): the others are its."""
    now = {key: value for key, value in flat_settings(settings_json).items() if trains_with(key)}
    started = flat_settings(saved)
    differing = {key: value for key, value in now.items() if key not in started or started[key] != value}
    for _ in range(3):  # the data-parallel ranks of one start, on other machines, may write it meanwhile
        raw = store.read(HISTORY_KEY)  # on object storage the write below is refused if another wrote since
        entries = _entries(raw, store)
        in_force = flat_settings(_in_force(saved, entries, step))
        superseded = any(entry["after_step"] > step for entry in entries)
        if now == {key: value for key, value in in_force.items() if trains_with(key)} and not superseded:
            return
        body = json.dumps({"format": HISTORY_FORMAT, "entries": entries + [{"after_step": int(step),
                                                                            "settings": differing}]},
                          indent=2, sort_keys=True).encode()
        try:
            store.write(HISTORY_KEY, body) if raw is not None else store.create(HISTORY_KEY, body)
            return
        except StaleWriterError:
            continue
    raise StaleWriterError(f"{store.describe(HISTORY_KEY)} kept changing while this start recorded its settings")


def history_entries(store: Any) -> list[dict[str, Any]]:
    """The run's resumes with other training settings, oldest first: ``{"after_step": N, "settings":
    {dotted name: value, for those that differ from settings.json}}``."""
    return _entries(store.read(HISTORY_KEY), store)


def flat_settings(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Settings JSON as ``{dotted name: value}``, the names ``--set`` takes."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flat_settings(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def set_dotted(settings: dict[str, Any], key: str, value: Any) -> None:
    """Sets the dotted setting ``key`` (``learner.loss.kl_coef``) in settings JSON, making its sections."""
    *sections, name = key.split(".")
    for section in sections:
        settings = settings.setdefault(section, {})
    settings[name] = value


def _in_force(saved: dict[str, Any], entries: list[dict[str, Any]], step: int) -> dict[str, Any]:
    at_or_before = [entry for entry in entries if entry["after_step"] <= step]
    if not at_or_before:
        return saved
    in_force = copy.deepcopy(saved)
    for key, value in at_or_before[-1]["settings"].items():
        set_dotted(in_force, key, value)
    return in_force


def _entries(raw: bytes | None, store: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    history = json_object(raw)
    entries = history.get("entries") if isinstance(history, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("after_step"), int)
            and isinstance(entry.get("settings"), dict) for entry in entries):
        raise StateFileError(f"{store.describe(HISTORY_KEY)} is damaged (not the history this library writes); "
                             f"restore it from a copy, or delete it to take settings.json's settings for every step")
    return entries
