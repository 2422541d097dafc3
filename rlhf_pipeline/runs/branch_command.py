"""The command that continues a branch, as ``branch`` prints it: the parent's own command, rebuilt
from what the branch recorded, under the branch's name.

A run records no command line, but its ``settings.json`` holds every setting it was started with and
its pipeline copy (``pipeline.py``) gives the defaults: each setting that differs from its default is a
``--set``. All are given again because a setting left out resumes with its default, which for a
``learner.*`` setting is only noted (``runs/run_directory.py``), so it would change silently. A replay
parent's own flags (``--buffer``, ``--epochs``, ``--order``, ``--seed``, ...) come from the ``replay``
record its ``settings.json`` keeps. Design: docs/branching.md#the-command.
"""

from __future__ import annotations

import shlex
from typing import Any

from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.files.settings_history import flat_settings, saved_settings
from rlhf_pipeline.pipeline import PipelineError, make_settings, settings_to_json, zarr_where_the_buffer_is_a_url
from rlhf_pipeline.runs.lineage import PARENT_ROWS
from rlhf_pipeline.runs.pipeline_copy import load_copy
from rlhf_pipeline.runs.setting_changes import as_set_value
from rlhf_pipeline.runs.replay_options import ReplayOptions

# settings the replay command gives by its own flags (it sets `steps` from --epochs/--steps)
_REPLAY_FLAGS_SET = ("steps",)


def recorded_sets(settings: dict[str, Any], module: Any, *, run_at_a_url: bool = False) -> list[str]:
    """``KEY=VALUE`` for each setting in ``settings`` (a run's ``settings.json``) that differs
    from the default of the pipeline ``module``, in the form ``--set`` parses, sorted by key;
    ``buffer_backend=zarr`` not where the buffer is at a URL (``run_at_a_url``, or ``buffer_url``),
    which makes it so. Checked by applying them: a value ``--set`` cannot give back raises
    ``ValueError`` naming it."""
    wanted = flat_settings({k: v for k, v in settings.items() if k != "replay"})

    def differing(defaults: dict[str, Any]) -> list[str]:
        flat = flat_settings(defaults)
        return [key for key in sorted(wanted) if wanted[key] != flat.get(key)]

    sets = [f"{key}={as_set_value(wanted[key])}" for key in differing(settings_to_json(make_settings(module)))]
    lost = differing(settings_to_json(make_settings(module, sets)))
    if lost:
        raise ValueError(f"setting(s) {', '.join(lost)} cannot be given back with --set")
    implied = [item for item in sets if item != "buffer_backend=zarr"]  # by where the buffer is: unsaid
    return implied if "buffer_backend=zarr" in zarr_where_the_buffer_is_a_url(implied, run_at_a_url=run_at_a_url) \
        else sets


def _pipeline_and_sets(paths: Any, settings: dict[str, Any]) -> tuple[str, list[str]]:
    """The pipeline file a command for the run at ``paths`` gives (its copy in a directory, else PIPELINE.py)
    and :func:`recorded_sets` of its ``settings``."""
    local = paths.url is None and not (paths.root / "pipeline_modules").exists()
    pipeline = str(paths.root / "pipeline.py") if local else "PIPELINE.py"
    return pipeline, recorded_sets(settings, load_copy(paths), run_at_a_url=paths.url is not None)


def branch_commands(paths: Any, lineage: dict[str, Any], parent_rows: str) -> dict[str, str]:
    """The commands that continue the branch at ``paths`` (a ``RunPaths``), as shell lines, from its
    ``settings.json`` and pipeline copy: ``"replay"`` for a branch of a replay; ``"online"`` and
    ``"offline"`` for a branch of a run with collectors (``parent_rows``: where its ``parent-rows/``
    is). The pipeline file given is the branch's copy in a directory, else PIPELINE.py: at a URL (any
    machine may continue it), or where the copy imports modules beside it (they load from
    ``pipeline_modules/`` only in a run's start). ``PipelineError``, ``ValueError`` or ``OSError``
    when it cannot be rebuilt."""
    settings = saved_settings(paths.store)
    if settings is None:
        raise ValueError(f"{paths.location} keeps no settings.json")
    pipeline, recorded = _pipeline_and_sets(paths, settings)
    sets = [word for item in recorded for word in ("--set", item)]
    replay_sets = [word for item in recorded if item.split("=", 1)[0] not in _REPLAY_FLAGS_SET
                   for word in ("--set", item)]
    place = ["--home", paths.home, "--run-name", paths.name]
    if lineage.get("replay_source") is not None:
        flags = ReplayOptions.recorded(settings.get("replay", {})).flags()  # each given back as recorded
        return {"replay": shlex.join(["rlhf-pipeline", "replay", pipeline, "--buffer", lineage["replay_source"],
                                      *flags, *place, *replay_sets])}
    collectors = len(lineage.get("buffer_rows") or {})
    many = ["--collectors", str(collectors)] if collectors > 1 else []
    return {"online": shlex.join(["rlhf-pipeline", "run", pipeline, *many, *place, *sets]),
            "offline": shlex.join(["rlhf-pipeline", "replay", pipeline, "--buffer", parent_rows, *place,
                                   *replay_sets])}


def start_over_command(paths: Any, settings: dict[str, Any]) -> str:
    """How to start again from the initial policy of the run at ``paths`` (``settings``: its ``settings.json``),
    which no checkpoint keeps and its pipeline builds again from the same seed and settings: the parent's own
    command under a new name, for a branch asked for at step 0."""
    if "replay" in settings:
        return "give its replay command again under a new --run-name, with the --set values of yours"
    try:
        pipeline, recorded = _pipeline_and_sets(paths, settings)
    except (PipelineError, ValueError, OSError):
        return "run its pipeline under a new --run-name with every --set its settings.json records, and yours"
    command = shlex.join(["rlhf-pipeline", "run", pipeline, "--home", paths.home, "--run-name", "NAME",
                          *(word for item in recorded for word in ("--set", item))])
    return f"run {command} with the --set values of yours"


def branch_message(new: str, lineage: dict[str, Any]) -> str:
    """The line ``branch`` ends with: how to continue the branch at ``new``, the parent's command
    with every setting it was started with and the branch's changes."""
    step = lineage["step"]
    try:
        commands = branch_commands(RunPaths.at(new), lineage, f"{new}/{PARENT_ROWS}")
    except (PipelineError, ValueError, OSError) as exc:
        return (f"continue it with the parent's command under the branch's name, giving every --set the parent was "
                f"given (its settings.json has them) and the branch's: {' '.join(lineage['overrides'])} (the command "
                f"could not be rebuilt: {exc})")
    # PIPELINE.py where the branch's copy cannot be run in place (at a URL, or importing modules beside it)
    given = any("PIPELINE.py" in command for command in commands.values())
    note = f" (PIPELINE.py: the parent's pipeline file, kept at {new}/pipeline.py)" if given else ""
    if "replay" in commands:
        return f"continue it with the parent's replay command under the branch's name{note}: {commands['replay']}"
    return (f"continue it online with the parent's run command under the branch's name{note}: {commands['online']} "
            f"(or offline over the parent's rows up to step {step}, --epochs/--steps counting from the parent's "
            f"step 0: {commands['offline']})")


def offline_command(paths: Any, lineage: dict[str, Any], parent_rows: str) -> str:
    """The ``replay`` command that continues the branch of a run with collectors at ``paths``
    offline, as ``branch`` printed it: what a refusal to continue it online names."""
    try:
        return branch_commands(paths, lineage, parent_rows)["offline"]
    except (PipelineError, ValueError, OSError):  # the parent's own command, to be completed by hand
        return shlex.join(["rlhf-pipeline", "replay", "PIPELINE.py", "--buffer", parent_rows, "--home", paths.home,
                           "--run-name", paths.name]) + " with every --set of the parent"

