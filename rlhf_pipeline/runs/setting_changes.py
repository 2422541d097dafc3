"""Which settings a start of a run may change from those its rows so far were made with: a resume
(``run_directory.prepare_run_directory``, ``replay``) and a branch's ``--set`` (``branch.py``) ask the
same :func:`may_change_on_resume`; :func:`settings_changes` says what differs, notes what may, and
returns what may not. Design: docs/branching.md.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from typing import Any

from rlhf_pipeline.files.settings_history import flat_settings, trains_with
from rlhf_pipeline.pipeline import settings_to_json

# settings that may change between starts of one run; the training settings (learner.*, max_lag: recorded
# per resume, files/settings_history.py) and a section's RESUMABLE ones may too, with a note; the rest define
# the data in the buffer and must match (the buffer's writer lock does not; eval.* says what is evaluated)
_RESUMABLE_SETTINGS = {"steps", "device", "ray", "buffer_lock_wait_s", "buffer_lock_lease_s", "max_lag", "eval"}


def settings_changes(saved: dict, settings: Any, *, tag: str, since: str) -> list[str]:
    """What differs between ``saved`` settings JSON and ``settings``; learner knobs and how the collector
    reaches its engine may change on resume (the data stays valid): those are printed as a note."""
    retired = _declared(settings, "REMOVED", "RENAMED")  # a setting gone or renamed since: the rows it saw stand
    saved, current, defaults = (flat_settings(d) for d in (saved, settings_to_json(settings),
                                                           _default_settings(settings)))
    changed = {key: f"{key}: was {saved.get(key)!r}, now {current.get(key)!r}"
               for key in sorted(saved.keys() | current.keys())
               if not _named_by(key, retired) and saved.get(key) != current.get(key)
               # a setting added to the pipeline since the run started, left at its default
               and not (key not in saved and key in defaults and current[key] == defaults[key])}
    allowed = {key for key in changed if may_change_on_resume(key, settings, saved.get(key), current.get(key))}
    noted = [key for key in changed if key in allowed and (key.split(".")[0] not in _RESUMABLE_SETTINGS
                                                           or trains_with(key))]
    if noted:
        print(f"{tag} note: settings changed since {since}: {'; '.join(changed[key] for key in noted)}",
              file=sys.stderr, flush=True)
    return [line for key, line in changed.items() if key not in allowed]


def as_set_value(value: Any) -> str:
    """``value`` as ``--set`` spells it (``pipeline.parse_value`` reads it back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(as_set_value(v) for v in value)
    return str(value)


def sets_giving_back(saved: dict, refused: list[str]) -> str:
    """The ``--set`` words that give back the ``saved`` values of the settings ``refused`` names (lines
    of :func:`settings_changes`): what a start refused for them adds to resume."""
    flat = flat_settings(saved)
    keys = [line.split(": was ", 1)[0] for line in refused]
    return " ".join(f"--set {shlex.quote(f'{key}={as_set_value(flat[key])}')}" for key in keys if key in flat)


def may_change_on_resume(key: str, settings: Any, was: Any = None, now: Any = None) -> bool:
    """Whether a start of a run (a resume, or a branch's ``--set``) may give the dotted setting ``key``
    another value (``was`` -> ``now``) than the rows so far were made with: the training settings
    (recorded: files/settings_history.py), the run settings that shape no row (steps, device, Ray,
    evaluation, lock waits), and how the collector reaches its engine (a section's ``RESUMABLE``:
    ``generation.url`` from one address to another, not to or from none, which would change the engine)."""
    if key.split(".")[0] in _RESUMABLE_SETTINGS or trains_with(key):
        return True
    return key in _declared(settings, "RESUMABLE") and (key != "generation.url" or None not in (was, now))


def _declared(settings: Any, *tables: str, prefix: str = "") -> set[str]:
    """The dotted names the settings classes of ``settings`` list in their ``tables`` (``REMOVED``,
    ``RENAMED``, ``RESUMABLE``). A renamed key is not mapped onto its new name: an old value need not mean
    one value of the new one (``rounds_ahead`` became ``max_lag``); the new name is compared from its default."""
    names = {prefix + name for table in tables for name in getattr(type(settings), table, ())}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names |= _declared(value, *tables, prefix=prefix + field.name + ".")
    return names


def _named_by(key: str, names: set[str]) -> bool:
    """Whether ``key`` or a section holding it is one of ``names``."""
    parts = key.split(".")
    return any(".".join(parts[:end]) in names for end in range(1, len(parts) + 1))


def _default_settings(settings: Any) -> dict:
    """The pipeline's default settings as JSON ({} when its settings class needs arguments)."""
    try:
        return settings_to_json(type(settings)())
    except TypeError:
        return {}
