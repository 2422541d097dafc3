"""``export --format chat``: one whole trajectory a line, as chat messages and per-turn token ids,
and ``import`` of that file back into the same rows.

The buffer is real: ``pipelines/tool_use.py``'s own collector (a tiny warm-started model calling
the ``multiply`` tool, its answers, the write path's group advantage) writes a few rounds, so the
trajectories have tool calls, tool answers, several turns and their real endings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_pipeline.agents.episode import rebuild_trajectory
from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.chat_trajectories import CHAT_FORMAT
from rlhf_pipeline.dataio.export import export_buffer, export_format
from rlhf_pipeline.dataio.importer import ImportOptions, import_source
from rlhf_pipeline.dataio.sources import SourceError
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline
from rlhf_pipeline.schema.termination import TerminationReason
from rlhf_pipeline.storage import create_store, open_buffer

REPO = Path(__file__).resolve().parents[2]
TOOL_USE = REPO / "pipelines" / "tool_use.py"
# enough warm start that the tiny model calls the tool in some episodes (multi-turn trajectories)
SMALL = ["warm_start_steps=40", "warm_start_check_tasks=0", "tasks_per_round=4", "group_size=4", "threads=1"]


def tool_use_pipeline(root: Path, *overrides: str):
    module = load_pipeline_module(TOOL_USE)
    return build_pipeline(module, make_settings(module, [*SMALL, *overrides]), RunPaths(root))


def all_rows(location):
    with open_buffer(str(location), mode="r") as store:
        return store.read(torch.arange(len(store)))


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(scope="module")
def agent_buffer(tmp_path_factory):
    """A memmap store written by the tool-use pipeline's collector: 3 rounds of 4 groups of 4 episodes."""
    root = tmp_path_factory.mktemp("tool_use")
    pipeline = tool_use_pipeline(root / "run")
    store = pipeline.create_buffer(root / "buffer")
    collector = pipeline.make_collector(pipeline.make_policy(), store)
    for _ in range(3):
        collector.collect()
    store.close()
    return root / "buffer", pipeline


@pytest.mark.slow
def test_a_chat_export_imports_back_into_the_same_rows_token_for_token(agent_buffer, tmp_path):
    source, pipeline = agent_buffer
    original = all_rows(source)
    # the premise: several turns, tool answers and more than one ending, on every optional field
    assert int(original["step"].max()) >= 1 and original["tool_calls"].sum() > 0
    assert {"advantage", "termination_reason", "tool_calls", "tool_errors", "turn_messages"} <= set(
        original.field_names)

    result = export_buffer(source, tmp_path / "chat.jsonl", "chat", rows_per_chunk=7)  # trajectories straddle chunks
    lines = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    assert result.rows == len(original) and result.trajectories == len(lines) == int(original["done"].sum())
    assert result.trajectories_skipped == 0
    export_buffer(source, tmp_path / "rows.jsonl", "jsonl")  # the row format carries the new fields too

    for name in ("chat.jsonl", "rows.jsonl"):
        # into a new buffer: the pipeline creates it, with the fields its collector writes
        # chunks of 5 rows: a trajectory's rows (one line) land in chunks of their own or straddle them
        logged: list[str] = []
        imported = import_source(tmp_path / name, tmp_path / f"back-{name}", pipeline,
                                 options=ImportOptions(show_progress=False, rows_per_chunk=5), log=logged.append)
        assert imported.rows_written == len(original) and imported.write_path == []  # advantages came with the rows
        assert all_rows(tmp_path / f"back-{name}").equal(original), name
        # said as what it is: no "one row per completion", no warning about plain prompt text (the
        # prompt's token ids came with it, rendered by the template when the rows were collected)
        assert not [line for line in logged if "warning" in line], logged
        if name == "chat.jsonl":
            assert "chat messages (export --format chat): one row per model turn" in logged[0], logged[0]


def test_each_line_is_the_conversation_and_the_exact_token_list(agent_buffer, tmp_path):
    source, _ = agent_buffer
    original = all_rows(source)
    export_buffer(source, tmp_path / "chat.jsonl", "chat")
    lines = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    ids = original["trajectory_id"]
    roles_seen = set()
    for line in lines:
        assert line["format"] == CHAT_FORMAT
        rows = original.select(torch.nonzero(ids == line["trajectory_id"]).squeeze(1))
        rebuilt = rebuild_trajectory(rows)
        # the token list is the turns' prompt and completion ids in order, the loss on completions only
        tokens = [t for turn in line["turns"] for t in turn["prompt_ids"] + turn["completion_ids"]]
        mask = [m for turn in line["turns"] for m in [0] * len(turn["prompt_ids"]) + [1] * len(turn["completion_ids"])]
        assert tokens == rebuilt.token_ids.tolist() and mask == rebuilt.loss_mask.int().tolist()
        log_probs = [p for turn in line["turns"] for p in turn["completion_logprobs"]]
        assert log_probs == rows["response_log_probs"].values.tolist()  # float32 values, exactly
        assert line["turn_rewards"] == rows["reward"].tolist() and line["return"] == sum(rows["reward"].tolist())
        assert line["final_reward"] == rows["reward"].tolist()[-1]
        assert line["termination_reason"] == TerminationReason(int(rows["termination_reason"][-1])).name
        assert line["done"] and line["terminated"] == bool(rows["terminated"][-1])
        # messages: the opening user message, then per turn the model's message and what answered it
        messages = line["messages"]
        assert messages[0] == {"role": "user", "content": messages[0]["content"]}
        assert [m["role"] for m in messages].count("assistant") == len(line["turns"])
        for turn in line["turns"]:
            _, stop = turn["messages"]
            assert messages[stop - 1]["role"] == "assistant"  # each turn ends with the model's own message
            assert turn["completion_text"].startswith(messages[stop - 1]["content"])
        roles_seen |= {m["role"] for m in messages}
        assert [t["tool_calls"] for t in line["turns"]] == rows["tool_calls"].tolist()
    assert {"user", "assistant", "tool"} <= roles_seen


def test_chat_lines_that_cannot_be_rows_are_refused_naming_the_line_and_field(agent_buffer, tmp_path):
    source, pipeline = agent_buffer
    export_buffer(source, tmp_path / "chat.jsonl", "chat")
    line = json.loads((tmp_path / "chat.jsonl").read_text(encoding="utf-8").splitlines()[0])
    for change, message in ((lambda d: d.update(termination_reason="DONE"), "'termination_reason' is 'DONE'"),
                            (lambda d: d["turns"][0].update(step=3), r"turns\[0\] has step 3"),
                            (lambda d: d.update(trajectory_id="7"), "'trajectory_id' must be int"),
                            (lambda d: d["turns"][0].update(messages=[0, 999]), r"turns\[0\].messages must be")):
        bad = json.loads(json.dumps(line))
        change(bad)
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(bad) + "\n", encoding="utf-8")
        with pytest.raises(SourceError, match=f"bad.jsonl line 1: a chat trajectory line: .*{message}"):
            import_source(path, tmp_path / "never", pipeline, options=ImportOptions(show_progress=False), log=quiet)


def test_trajectories_not_held_whole_are_skipped_and_the_cli_says_so(agent_buffer, tmp_path, capsys):
    source, _ = agent_buffer
    original = all_rows(source)
    first_multi = int(torch.nonzero(original["step"] == 1)[0])  # a trajectory's second turn
    with open_buffer(str(source), mode="r") as store:
        schema = store.schema
    with create_store(tmp_path / "cut", "memmap", schema) as store:  # as if its first turn was evicted
        store.append(original.select(torch.arange(first_multi, len(original))))
    assert main(["export", str(tmp_path / "cut"), str(tmp_path / "cut.jsonl"), "--format", "chat", "--quiet"]) == 0
    out = capsys.readouterr().out
    whole = int(original["done"][first_multi:].sum()) - 1
    assert f"{whole} trajectories from {len(original) - first_multi} rows (1 not held whole were skipped)" in out
    assert len((tmp_path / "cut.jsonl").read_text(encoding="utf-8").splitlines()) == whole
    # chat is JSONL: a .jsonl name takes --format chat, not the other formats' suffixes
    assert export_format("x.jsonl", "chat") == "chat"
    with pytest.raises(ValueError, match="contradicts"):
        export_format("x.parquet", "chat")


def test_single_turn_rows_are_one_turn_trajectories_without_messages(collected_buffers, tmp_path):
    """A buffer of the single-turn collector (no turn_messages): one line per row, messages null,
    and the import gives the rows back field for field."""
    from dataio_setup import SMALL as DEFAULT_SMALL
    from dataio_setup import WRITE_PATH_FIELDS

    from rlhf_pipeline.schema import StoreSchema

    source = collected_buffers["memmap"]
    original = all_rows(source)
    result = export_buffer(source, tmp_path / "chat.jsonl", "chat")
    lines = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    assert result.trajectories == len(lines) == len(original)
    assert all(line["messages"] is None and len(line["turns"]) == 1 for line in lines)
    assert [line["turns"][0]["completion_ids"] for line in lines] == [t.tolist() for t in original["response_tokens"].to_list()]
    create_store(tmp_path / "back", "memmap", schema=StoreSchema(optional=WRITE_PATH_FIELDS)).close()
    module = load_pipeline_module(REPO / "pipelines" / "default.py")
    pipeline = build_pipeline(module, make_settings(module, list(DEFAULT_SMALL)), RunPaths(tmp_path / "run"))
    import_source(tmp_path / "chat.jsonl", tmp_path / "back", pipeline, options=ImportOptions(show_progress=False),
                  log=quiet)
    assert all_rows(tmp_path / "back").equal(original)
