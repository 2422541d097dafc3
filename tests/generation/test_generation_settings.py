"""``generation.*``: each engine's options live on that engine only (``GenerationSettings.ENGINES``), so a
setting that means nothing for the run's engine is refused in one line naming it, the engine it is for
and the run's; what needs the machine (a GPU, vLLM's CPU head sizes) is ``check_generation``'s."""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path

import pytest

from rlhf_pipeline.generation.settings import EVERY, GenerationSettings, check_generation
from rlhf_pipeline.pipeline import PipelineError, RunPaths, apply_overrides, load_pipeline_module, make_settings

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "pipelines" / "default.py"
URL = "http://127.0.0.1:8000"
FIELDS = {f.name: f for f in dataclasses.fields(GenerationSettings)}
CHOSEN_BY = {"loop": {}, "vllm": {"engine": "vllm"}, "url": {"url": URL}}


def _other_value(name: str):
    """A value of the field ``name`` other than its default that its own range checks take."""
    default = FIELDS[name].default
    hint = typing.get_type_hints(GenerationSettings)[name]
    choices = [c for c in (typing.get_args(hint) or ()) if isinstance(c, str) and c != default]
    if choices:
        return choices[0]
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default / 2 if 0 < default <= 1 else default + 1
    if isinstance(default, int) or int in typing.get_args(hint):
        return (default or 63) + 1
    return "something"


def test_the_table_names_an_engine_for_every_setting_and_nothing_else():
    assert set(FIELDS) <= set(GenerationSettings.ENGINES)
    for key, engines in GenerationSettings.ENGINES.items():
        name, _, value = key.partition("=")
        assert name in FIELDS, f"ENGINES names {key!r}, which is no setting"
        assert engines and set(engines) <= set(EVERY), key
        if value:  # a value's engines narrow its setting's
            assert set(engines) <= set(GenerationSettings.ENGINES[name]), key


@pytest.mark.parametrize("name", sorted(set(FIELDS) - {"engine", "url"}))
def test_every_setting_is_taken_by_its_engines_and_refused_by_the_others(name):
    value = _other_value(name)
    key = f"{name}={value}" if f"{name}={value}" in GenerationSettings.ENGINES else name
    for engine, chooses in CHOSEN_BY.items():
        if engine in GenerationSettings.ENGINES[key]:
            GenerationSettings(**chooses, **{name: value})
            continue
        with pytest.raises(ValueError) as caught:
            GenerationSettings(**chooses, **{name: value})
        message = str(caught.value)
        assert message.startswith(f"setting 'generation.{key}' is for ") and message.endswith(": drop it"), message
        assert "\n" not in message


@pytest.mark.parametrize(("changes", "message"), [
    ({"kv_cache_gib": 2}, "setting 'generation.kv_cache_gib' is for generation.engine=vllm; this run generates with "
                          "the loop: drop it"),
    ({"url": URL, "max_num_seqs": 8}, "setting 'generation.max_num_seqs' is for generation.engine=vllm; this run "
                                      "generates with the server at generation.url: drop it"),
    ({"engine": "vllm", "url_model": "tiny"}, "setting 'generation.url_model' is for generation.url; this run "
                                              "generates with the collector's own vLLM server "
                                              "(generation.engine=vllm): drop it"),
    ({"retries": 0}, "setting 'generation.retries' is for generation.engine=vllm or generation.url; this run "
                     "generates with the loop: drop it"),
    ({"engine": "vllm", "weight_transfer": "inline"}, "setting 'generation.weight_transfer=inline' is for "
                                                      "generation.url; this run generates with the collector's own"),
    ({"url": URL, "weight_transfer": "nccl"}, "setting 'generation.weight_transfer=nccl' is for "
                                              "generation.engine=vllm; this run generates with the server at"),
    ({"weight_transfer": "nccl"}, "setting 'generation.weight_transfer=nccl' is for generation.engine=vllm; this "
                                  "run generates with the loop: drop it"),
    ({"url": URL, "engine": "vllm"}, f"generation.url={URL} names a server you started and generation.engine=vllm "
                                     f"starts one of the collector's own: drop one of them"),
])
def test_a_setting_for_another_engine_is_refused_naming_both_engines_and_the_fix(changes, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        GenerationSettings(**changes)


def test_an_engines_settings_at_their_defaults_are_no_choice_and_taken_by_every_engine():
    """settings.json keeps every setting, defaults included: a run of any engine reads its own back."""
    for chooses in CHOSEN_BY.values():
        settings = GenerationSettings(**chooses)
        assert dataclasses.replace(settings) == settings


@pytest.mark.parametrize(("changes", "named"), [
    ({"engine": "vllm", "kv_cache_gib": 0}, "'generation.kv_cache_gib' must be >= 1"),
    ({"engine": "vllm", "gpu_memory_utilization": 1.5}, "'generation.gpu_memory_utilization' must be in (0, 1]"),
    ({"engine": "vllm", "max_model_len": 1}, "'generation.max_model_len' must be >= 2"),
    ({"engine": "vllm", "max_num_seqs": 0}, "'generation.max_num_seqs' must be >= 1"),
    ({"engine": "vllm", "start_timeout_s": -1.0}, "'generation.start_timeout_s' must be >= 0"),
    ({"url": URL, "timeout_s": 0.0}, "'generation.timeout_s' must be > 0"),
    ({"url": "ftp://host"}, "'generation.url' must be an http:// or https:// URL"),
])
def test_a_value_its_own_engine_does_not_take_is_refused_where_it_is_declared(changes, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("]", r"\]")):
        GenerationSettings(**changes)


def test_set_refuses_another_engines_setting_in_one_line_whatever_the_order():
    module = load_pipeline_module(DEFAULT)
    with pytest.raises(PipelineError, match=r"^setting 'generation.max_num_seqs' is for generation.engine=vllm; "
                                            r"this run generates with the loop: drop it$"):
        make_settings(module, ["generation.max_num_seqs=8"])
    # the engine and its options given together, in either order
    for overrides in (["generation.max_num_seqs=8", "generation.engine=vllm"],
                      ["generation.engine=vllm", "generation.max_num_seqs=8"]):
        assert make_settings(module, overrides).generation.max_num_seqs == 8


def test_a_vllm_runs_settings_switched_to_the_loop_are_refused_in_one_line(tmp_path):
    """A run made with vLLM options, its settings.json read back and given generation.engine=loop (a
    resume, a replay or a branch that tried): one line naming the option, no traceback; a branch refuses
    the engine itself first, its rows having been made with it."""
    from rlhf_pipeline.dataio.run_pipeline import settings_from_json
    from rlhf_pipeline.pipeline import settings_to_json
    from rlhf_pipeline.runs.branch import BranchError, changed_settings

    module = load_pipeline_module(DEFAULT)
    saved = settings_to_json(make_settings(module, ["generation.engine=vllm", "generation.kv_cache_gib=2"]))
    settings = settings_from_json(module, json.loads(json.dumps(saved)))
    assert settings.generation.kv_cache_gib == 2
    with pytest.raises(PipelineError, match=r"^setting 'generation.kv_cache_gib' is for generation.engine=vllm; "
                                            r"this run generates with the loop: drop it$"):
        apply_overrides(settings, ["generation.engine=loop"])
    (tmp_path / "settings.json").write_text(json.dumps(saved))
    shutil.copy(DEFAULT, tmp_path / "pipeline.py")
    with pytest.raises(BranchError, match=r"^--set generation.engine: cannot change at a branch point"):
        changed_settings(RunPaths(tmp_path), saved, ["generation.engine=loop"])


def test_only_the_collectors_own_server_asks_this_machine_for_anything(tmp_path):
    check_generation(GenerationSettings(), head_size=16)  # the loop runs any model, needs no vLLM
    check_generation(GenerationSettings(url=URL), head_size=16)  # the server's machine is the user's
    with pytest.raises(ValueError, match="'generation.weight_transfer=nccl' needs a GPU"):
        check_generation(GenerationSettings(engine="vllm", weight_transfer="nccl"), device="cpu")
    with pytest.raises(ValueError, match=r"vLLM's CPU attention takes head sizes .* this model's is 16"):
        check_generation(GenerationSettings(engine="vllm"), head_size=16, device="cpu")
    with pytest.raises(ValueError, match="'generation.python' is .* which does not exist"):
        check_generation(GenerationSettings(engine="vllm", python=str(tmp_path / "python")), device="cpu")


# ====================================================================== settings that went
@pytest.mark.parametrize(("name", "says"), [
    ("url_api_key_env", r"\$VLLM_API_KEY, vLLM's own variable"),
    ("url_lease_s", "lives 60 s without renewal"),
    ("enforce_eager", "eager on a CPU and compiled"),
])
def test_a_removed_setting_is_refused_in_one_line_saying_what_replaced_it(name, says):
    assert name in GenerationSettings.REMOVED and name not in FIELDS and name not in GenerationSettings.ENGINES
    with pytest.raises(PipelineError, match=rf"^setting 'generation.{name}' was removed: .*{says}.*; drop it$"):
        make_settings(load_pipeline_module(DEFAULT), ["generation.engine=vllm", f"generation.{name}=1"])


def test_a_run_started_with_a_removed_setting_resumes_without_it():
    """settings.json of a run started before a setting went still holds it: resuming compares the rest."""
    from rlhf_pipeline.pipeline import settings_to_json
    from rlhf_pipeline.runs.run_directory import settings_changes

    settings = make_settings(load_pipeline_module(DEFAULT), ["generation.engine=vllm"])
    saved = settings_to_json(settings)
    saved["generation"].update(enforce_eager=False, url_lease_s=60.0, url_api_key_env="MY_KEY")
    assert settings_changes(saved, settings, tag="[run]", since="the run started") == {}
    saved["generation"]["max_num_seqs"] = 8  # a setting that stays still has to match
    assert settings_changes(saved, settings, tag="[run]", since="the run started") == {
        "generation.max_num_seqs": "generation.max_num_seqs: was 8, now 256"}


def test_a_run_started_with_a_renamed_setting_resumes_and_its_new_name_is_compared_from_its_default(capsys):
    """A run started before url_retries and max_restarts became retries (or rounds_ahead became max_lag)
    resumes; its new name is compared from its default, like a setting added since (retries may change
    on resume: said in the note)."""
    from rlhf_pipeline.pipeline import settings_to_json
    from rlhf_pipeline.runs.run_directory import settings_changes

    settings = make_settings(load_pipeline_module(DEFAULT), ["generation.engine=vllm"])
    saved = settings_to_json(settings)
    del saved["generation"]["retries"], saved["max_lag"]
    saved["generation"].update(url_retries=3, max_restarts=2)
    saved.update(rounds_ahead=1, rounds_per_version=1)
    assert settings_changes(saved, settings, tag="[run]", since="the run started") == {}
    assert "note" not in capsys.readouterr().err
    more_retries = make_settings(load_pipeline_module(DEFAULT), ["generation.engine=vllm", "generation.retries=9"])
    assert settings_changes(saved, more_retries, tag="[run]", since="the run started") == {}
    assert capsys.readouterr().err == ("[run] note: settings changed since the run started: generation.retries: was "
                                       "None, now 9\n")


def test_a_resume_may_reach_its_engine_elsewhere_but_not_change_which_engine_samples(capsys):
    """A server restarted at another address, a vLLM environment made again elsewhere, more patience:
    noted, and the run resumes (it said "started with other settings", and the learner's checkpoint
    waited for a command that could not be given). Going to or from a server, or what the engine
    samples with, is still refused."""
    from rlhf_pipeline.pipeline import settings_to_json
    from rlhf_pipeline.runs.run_directory import settings_changes

    module = load_pipeline_module(DEFAULT)
    started = ["generation.url=http://10.0.0.1:8000", "generation.start_timeout_s=5"]
    saved = settings_to_json(make_settings(module, started))
    moved = make_settings(module, ["generation.url=http://10.0.0.2:8001", "generation.start_timeout_s=60",
                                   "generation.timeout_s=30"])
    assert settings_changes(saved, moved, tag="[run]", since="the run started") == {}
    note = capsys.readouterr().err
    assert note.startswith("[run] note: settings changed since the run started: ") and note.count("\n") == 1
    assert "generation.url: was 'http://10.0.0.1:8000', now 'http://10.0.0.2:8001'" in note
    assert "generation.start_timeout_s: was 5.0, now 60.0" in note and "generation.timeout_s: was 600.0" in note
    assert settings_changes(saved, make_settings(module), tag="[run]", since="the run started") == {
        "generation.url": "generation.url: was 'http://10.0.0.1:8000', now None"}  # our loop samples instead of the server
    loop = settings_to_json(make_settings(module))
    assert settings_changes(loop, make_settings(module, started[:1]), tag="[run]", since="the run started") == {
        "generation.url": "generation.url: was None, now 'http://10.0.0.1:8000'"}
    assert settings_changes(saved, make_settings(module, ["generation.engine=vllm"]), tag="[run]",
                            since="the run started") == {
        "generation.engine": "generation.engine: was 'loop', now 'vllm'",
        "generation.url": "generation.url: was 'http://10.0.0.1:8000', now None"}


@pytest.mark.parametrize(("device", "eager"), [("cpu", True), ("cuda", False)])
def test_the_collectors_own_server_runs_eager_on_a_cpu_and_compiled_on_a_gpu(tmp_path, device, eager):
    """What generation.enforce_eager chose: the command the engine starts vLLM with, recorded by a
    stand-in for the vLLM environment's Python that exits at once (the start is then refused)."""
    from rlhf_pipeline.generation.engine import EngineFailed
    from rlhf_pipeline.generation.vllm_engine import VLLMEngine
    from rlhf_pipeline.models import tiny_model_and_tokenizer

    log, python = tmp_path / "argv", tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexit 3\n')
    python.chmod(0o755)
    model, tok = tiny_model_and_tokenizer(hidden_size=64, num_heads=2, num_layers=1)
    with pytest.raises(EngineFailed):
        VLLMEngine.from_model(model, python=str(python), stop_token_ids=[tok.eos_token_id], device=device,
                              work_dir=tmp_path / "scratch", start_timeout_s=60)
    command = log.read_text()
    assert "vllm.entrypoints.openai.api_server" in command and ("--enforce-eager" in command) == eager


def test_the_resume_section_names_every_setting_a_resume_may_change():
    """docs/pipelines.md#resume lists what a resume may change; a name added to RESUMABLE is added there."""
    assert GenerationSettings.RESUMABLE <= FIELDS.keys()  # a misspelt name would never match a setting
    page = (REPO / "docs" / "pipelines.md").read_text(encoding="utf-8")
    section = page.split("\n## Resume\n", 1)[1].split("\n## ", 1)[0]
    assert [name for name in sorted(GenerationSettings.RESUMABLE) if f"`{name}`" not in section
            and f"`generation.{name}`" not in section] == []
