"""``import`` from text datasets, logged inference traffic and bad input; after ``kill -9``. Into a run:
``tests/integration/test_import_into_run.py``."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from dataio_setup import DEFAULT_PIPELINE, GROUP_SIZE, REPO, SMALL, WRITE_PATH_FIELDS
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.columns import ColumnMap
from rlhf_pipeline.dataio.importer import ImportOptions, ImportStopped, import_source
from rlhf_pipeline.dataio.sources import SourceError
from rlhf_pipeline.models import char_tokenizer
from rlhf_pipeline.pipeline import RunPaths, load_pipeline_module, make_settings
from rlhf_pipeline.runs.processes import build_pipeline
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store, open_buffer, open_store
from rlhf_pipeline.transforms.ref_logprobs import reference_log_probs

QUIET = ImportOptions(show_progress=False)


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    module = load_pipeline_module(DEFAULT_PIPELINE)
    return build_pipeline(module, make_settings(module, list(SMALL)), RunPaths(tmp_path_factory.mktemp("p")))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def toy_records(groups: int, per_prompt: bool = False):
    """Addition prompts with GROUP_SIZE completions each, right ones rewarded."""
    records = []
    for g in range(groups):
        a, b = g % 17, (3 * g) % 13
        completions = [str(a + b + d) for d in (0, 1, 0, -1)][:GROUP_SIZE]
        rewards = [float(c == str(a + b)) for c in completions]
        messages = [{"role": "user", "content": f"{a}+{b}="}]
        if per_prompt:
            records.append({"messages": messages, "completions": completions, "rewards": rewards})
        else:
            records += [{"messages": messages, "completion": c, "reward": r, "source": "toy"}
                        for c, r in zip(completions, rewards)]
    return records


def rows_of(location):
    with open_buffer(str(location), mode="r") as store:
        return store.read(torch.arange(len(store)))


# ====================================================================== text datasets
@pytest.mark.parametrize("per_prompt", [False, True])
def test_text_rows_are_tokenized_grouped_scored_and_written_through_the_write_path(pipeline, tmp_path, per_prompt):
    source = write_jsonl(tmp_path / "toy.jsonl", toy_records(6, per_prompt))
    result = import_source(source, tmp_path / "buf", pipeline, options=QUIET, log=quiet)
    assert (result.completions, result.groups, result.rows_written) == (24, 6, 24)
    assert result.write_path == ["GroupAdvantage"]
    rows = rows_of(tmp_path / "buf")
    tokenizer = char_tokenizer()
    # the chat template rendered as the collector renders it; completions end with EOS
    assert rows["prompt_text"][0] == "<|user|>0+0=<|assistant|>"
    assert rows["prompt_tokens"].row(0).tolist() == tokenizer.apply_chat_template(
        [{"role": "user", "content": "0+0="}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rows["response_tokens"].row(1).tolist() == [*tokenizer.encode("1", add_special_tokens=False),
                                                       tokenizer.eos_token_id]
    assert rows["response_text"][:4] == ["0", "1", "0", "-1"] and rows["terminated"].all()
    # groups by prompt, fresh ids, advantages normalized within each group by the write path
    assert rows["group_id"].tolist() == [g for g in range(6) for _ in range(GROUP_SIZE)]
    assert rows["trajectory_id"].tolist() == list(range(24))
    for g in range(6):
        adv = rows["advantage"][g * GROUP_SIZE:(g + 1) * GROUP_SIZE]
        assert abs(float(adv.mean())) < 1e-5 and float(adv.std()) == pytest.approx(1.0, abs=1e-4)
    # sampling log-probs from make_policy() at the pipeline's temperature
    expected = reference_log_probs(pipeline.make_policy(), rows["prompt_tokens"], rows["response_tokens"],
                                   temperature=pipeline.learner.temperature)
    assert torch.allclose(rows["response_log_probs"].values, expected.values, atol=1e-5)


def test_logged_inference_traffic_imports_ids_and_log_probs_as_given(pipeline, tmp_path):
    """Records shaped like a serving engine's: nested outputs with ids and per-token log-prob dicts."""
    tokenizer = char_tokenizer()
    records = []
    for g in range(2):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"{g}+1="}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        for k in range(GROUP_SIZE):
            ids = tokenizer.encode(str(g + k), add_special_tokens=False) + [tokenizer.eos_token_id]
            records.append({"request_id": f"req-{g}", "prompt_token_ids": prompt, "score": k / 3,
                            "outputs": [{"text": str(g + k), "token_ids": ids,
                                         "logprobs": [{"logprob": -0.25 * (i + 1)} for i in range(len(ids))]}]})
    source = write_jsonl(tmp_path / "traffic.jsonl", records)
    columns = ColumnMap(prompt_ids="prompt_token_ids", completion="outputs.0.text",
                        completion_ids="outputs.0.token_ids", log_probs="outputs.0.logprobs", reward="score",
                        group="request_id")
    result = import_source(source, tmp_path / "buf", pipeline, options=ImportOptions(columns=columns,
                                                                                       show_progress=False),
                           log=quiet)
    assert result.log_probs_from is None  # given, nothing scored
    rows = rows_of(tmp_path / "buf")
    assert rows["response_tokens"].row(5).tolist() == records[5]["outputs"][0]["token_ids"]
    assert rows["response_log_probs"].row(5).tolist() == [d["logprob"] for d in records[5]["outputs"][0]["logprobs"]]
    assert rows["prompt_text"][0] == "<|user|>0+1=<|assistant|>"  # decoded from the ids
    assert rows["group_id"].tolist() == [0] * 4 + [1] * 4  # string keys -> fresh ids in order

    # ids that decode to something else than the logged text are refused, naming the row
    records[6]["outputs"][0]["text"] = "99"
    bad = write_jsonl(tmp_path / "bad_traffic.jsonl", records)
    with pytest.raises(SourceError, match=r"bad_traffic.jsonl line 7, column 'outputs.0.token_ids': the token ids "
                                          r"decode to '3' but the text column holds '99'"):
        import_source(bad, tmp_path / "buf2", pipeline, options=ImportOptions(columns=columns), log=quiet)
    assert not (tmp_path / "buf2").exists()


# ====================================================================== bad input
def _lines(**changes):
    """toy_records(2) with edits {index: {field: value or None to delete}}."""
    records = toy_records(2)
    for index, edit in changes.items():
        for key, value in edit.items():
            if value is None:
                records[int(index[1:])].pop(key)
            else:
                records[int(index[1:])][key] = value
    return records


def _with_log_probs(records, bad_row: int, bad_value: float):
    """One log-prob per token (completion + EOS) on every row; ``bad_value`` last on ``bad_row``."""
    for i, record in enumerate(records):
        record["log_probs"] = [-1.0] * len(record["completion"]) + [bad_value if i == bad_row else -1.0]
    return records


@pytest.mark.parametrize("records, message", [
    (_lines(r2={"reward": None}), r"bad.jsonl line 3, column 'reward': missing"),
    (_lines(r1={"completion": 5}), r"bad.jsonl line 2, column 'completion': expected the completion as a string"),
    (_lines(r4={"reward": math.nan}), r"bad.jsonl line 5, column 'reward': nan is not finite"),
    (_lines(r5={"reward": "high"}), r"bad.jsonl line 6, column 'reward': expected a number, got 'high'"),
    # the first row decides the columns: every row needs them
    (_lines(r0={"log_probs": [-0.5, -0.5]}), r"bad.jsonl line 2, column 'log_probs': missing"),
    (_lines(r0={"log_probs": [-0.5, -0.5, -0.5]}, **{f"r{i}": {"log_probs": [-1.0, -1.0]} for i in range(1, 8)}),
     r"bad.jsonl line 1, column 'log_probs': 3 log-probs for a completion of 2 tokens"),
    (_with_log_probs(toy_records(2), bad_row=6, bad_value=0.5),
     r"bad.jsonl line 7, column 'log_probs': log-prob 0.5 is not a finite value <= 0"),
    (toy_records(2)[:7], r"bad.jsonl line 5: the group of this row has 3 completions, but the pipeline's group "
                         r"advantage takes groups of 4"),
    # a group of one: no group_size fits it, so none is offered
    (toy_records(2)[:5], r"bad.jsonl line 5: the group of this row has 1 completion, but the pipeline's group "
                         r"advantage takes groups of 4; import groups of that size \(a group advantage compares 2 or "
                         r"more completions of a prompt\)"),
])
def test_bad_input_names_file_row_and_column_and_writes_nothing(pipeline, tmp_path, records, message):
    existing = tmp_path / "existing"
    create_store(existing, "memmap", schema=pipeline.create_buffer(tmp_path / "probe").schema).close()
    before = sorted(p.relative_to(existing) for p in existing.rglob("*"))
    source = write_jsonl(tmp_path / "bad.jsonl", records)
    for target in (existing, tmp_path / "new"):
        with pytest.raises(SourceError, match=message):
            import_source(source, target, pipeline, options=QUIET, log=quiet)
    assert sorted(p.relative_to(existing) for p in existing.rglob("*")) == before  # untouched, no record
    assert not (tmp_path / "new").exists()


def test_a_split_of_one_file_is_refused_not_ignored(pipeline, tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", toy_records(1))
    with pytest.raises(SourceError, match=r"--split picks a split of a directory .*/rows.jsonl is one file: drop "
                                          r"--split"):
        import_source(source, tmp_path / "buf", pipeline, options=ImportOptions(split="train", show_progress=False),
                      log=quiet)
    assert not (tmp_path / "buf").exists()


def test_a_file_that_is_not_the_named_format(pipeline, tmp_path, capsys):
    binary = tmp_path / "rows.jsonl"
    binary.write_bytes(b"PAR1\x00\x15\x04\xff\xfe garbage")
    with pytest.raises(SourceError, match=r"rows.jsonl is not UTF-8 text .* so not JSONL"):
        import_source(binary, tmp_path / "buf", pipeline, options=QUIET, log=quiet)
    write_jsonl(tmp_path / "data.jsonl", toy_records(1))
    pytest.importorskip("pyarrow")
    code = main(["import", str(tmp_path / "data.jsonl"), str(tmp_path / "buf"), "--pipeline", str(DEFAULT_PIPELINE),
                 "--format", "parquet", *[a for s in SMALL for a in ("--set", s)]])
    assert code == 2
    assert "data.jsonl is not a Parquet file" in capsys.readouterr().err
    assert not (tmp_path / "buf").exists()


def test_missing_role_column_says_which_option_names_it(pipeline, tmp_path):
    source = write_jsonl(tmp_path / "x.jsonl", [{"question": "1+1=", "answer": "2", "score": 1.0}])
    with pytest.raises(SourceError, match=r"x.jsonl line 1 \(the first record\): no prompt column; name one with --prompt"):
        import_source(source, tmp_path / "buf", pipeline, options=QUIET, log=quiet)
    options = ImportOptions(columns=ColumnMap(prompt="question", completion="answer", reward="reward"))
    with pytest.raises(SourceError, match=r"column 'reward' \(given with --reward\) is missing"):
        import_source(source, tmp_path / "buf", pipeline, options=options, log=quiet)


# ====================================================================== kill -9
def big_source(directory):
    """400 rows in 100 appends of one group; given log-probs, so no model."""
    records = []
    for record in toy_records(100):
        n = len(record["completion"]) + 1
        records.append({**record, "log_probs": [-0.5] * n})
    return write_jsonl(directory / "big.jsonl", records)


@pytest.fixture(scope="module")
def clean_import(pipeline, tmp_path_factory):
    """The rows of big_source imported uninterrupted (larger appends: same rows, same ids), for the
    kill tests to compare with."""
    directory = tmp_path_factory.mktemp("clean")
    clean = directory / "clean"
    import_source(big_source(directory), clean, pipeline, options=ImportOptions(rows_per_chunk=64, show_progress=False),
                  log=quiet)
    return rows_of(clean)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_import_killed_midway_finishes_on_rerun_without_duplicates(pipeline, clean_import, tmp_path, sig):
    source = big_source(tmp_path)
    buffer = tmp_path / "buf"
    args = [sys.executable, "-m", "rlhf_pipeline.cli.main", "import", str(source), str(buffer), "--pipeline",
            str(DEFAULT_PIPELINE), "--rows-per-chunk", "4", "--quiet", *[a for s in SMALL for a in ("--set", s)]]
    # PYTHONFAULTHANDLER: if the child ever hangs, SIGABRT below prints where every thread stood
    process = preloaded.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    deadline = time.monotonic() + 240
    rows_at_kill = 0
    while time.monotonic() < deadline and process.poll() is None:
        if (buffer / "manifest.json").exists():
            try:
                with open_store(str(buffer), mode="r") as store:
                    rows_at_kill = len(store)
            except Exception:  # noqa: BLE001 - created a moment ago; look again
                rows_at_kill = 0
            if rows_at_kill >= 20:
                os.kill(process.pid, sig)
                break
        time.sleep(0.01)
    try:  # communicate, not wait: a child blocked on a full stderr pipe must not hang the test
        stderr = process.communicate(timeout=120)[1].decode()
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        pytest.fail(f"the import did not exit within 120 s of signal {sig}:\n{process.communicate()[1].decode()[-6000:]}")
    if sig == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL, stderr[-2000:]
    else:  # Ctrl-C: one line that says the same command resumes, exit 130
        assert process.returncode == 130, stderr[-2000:]
        assert "interrupted" in stderr and "run the same command again to resume" in stderr, stderr[-2000:]
        assert "Traceback" not in stderr
    assert 20 <= len(rows_of(buffer)) < 400

    if sig == signal.SIGKILL:
        result = import_source(source, buffer, pipeline,
                               options=ImportOptions(rows_per_chunk=4, show_progress=False), log=quiet)
        assert result.resumed_from_row >= 20
    else:  # the same command, as the message says (run in this process: a new one imports torch again)
        assert main(args[3:]) == 0
    resumed = rows_of(buffer)
    assert len(resumed) == 400 and resumed["trajectory_id"].unique().numel() == 400
    assert resumed.equal(clean_import)


def test_a_directory_of_parquet_data_files_with_a_split(pipeline, tmp_path):
    """A dataset repository's layout: data/<split>-NNNNN-of-NNNNN.parquet, chats as lists of structs."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    for split, groups in (("train", 3), ("test", 1)):
        records = toy_records(groups, per_prompt=True)
        pq.write_table(pa.Table.from_pylist(records), data / f"{split}-00000-of-00001.parquet")
    result = import_source(tmp_path / "repo", tmp_path / "buf", pipeline,
                           options=ImportOptions(split="train", show_progress=False), log=quiet)
    assert (result.source_rows, result.completions) == (3, 12)
    rows = rows_of(tmp_path / "buf")
    assert rows["prompt_text"][4] == "<|user|>1+3=<|assistant|>" and rows["response_text"][4] == "4"


# ====================================================================== ids, a changing source
def _with_trajectory_ids(records, ids):
    return [{**record, "trajectory_id": i} for record, i in zip(records, ids)]


@pytest.mark.parametrize("ids, message", [
    # a second row of one group under an id: two trajectories, or a step given twice
    ([0, 1, 2, 3, 4, 4, 6, 7], r"bad.jsonl line 6, column 'trajectory_id': step 0 of trajectory 4 is also at "
                               r"\S*bad.jsonl line 5; ids are unique in a buffer"),
    ([0, 1, 2, 3, 4, 5, 6, 0], r"bad.jsonl line 8, column 'trajectory_id': step 0 of trajectory 0 is also at "
                               r"\S*bad.jsonl line 1"),
])
def test_a_trajectory_id_given_twice_is_refused_before_anything_is_written(pipeline, tmp_path, ids, message):
    source = write_jsonl(tmp_path / "bad.jsonl", _with_trajectory_ids(toy_records(2), ids))
    with pytest.raises(SourceError, match=message):
        import_source(source, tmp_path / "new", pipeline, options=QUIET, log=quiet)
    assert not (tmp_path / "new").exists()


def test_a_trajectory_id_already_in_the_buffer_is_refused(pipeline, tmp_path):
    buffer = tmp_path / "buf"
    first = write_jsonl(tmp_path / "first.jsonl", _with_trajectory_ids(toy_records(2), range(8)))
    import_source(first, buffer, pipeline, options=QUIET, log=quiet)
    second = write_jsonl(tmp_path / "second.jsonl", _with_trajectory_ids(toy_records(2), range(7, 15)))
    with pytest.raises(SourceError, match=r"second.jsonl line 1, column 'trajectory_id': trajectory 7 is already in"):
        import_source(second, buffer, pipeline, options=QUIET, log=quiet)
    assert rows_of(buffer)["trajectory_id"].tolist() == list(range(8))


def test_a_source_that_grows_during_the_write_pass_stops_and_resumes_once_restored(pipeline, tmp_path):
    source = write_jsonl(tmp_path / "growing.jsonl", toy_records(8))
    original = source.read_bytes()
    options = ImportOptions(rows_per_chunk=4, show_progress=False)

    def grow_when_writing_starts(message: str) -> None:  # a writer appending to the file meanwhile
        if "sampling log-probs" in message:
            with open(source, "a", encoding="utf-8") as f:
                f.write(json.dumps(toy_records(9)[-1]) + "\n")

    with pytest.raises(SourceError, match=r"growing.jsonl changed during the import \(\S*growing.jsonl line 33 "
                                          r"onwards differs from what the check pass read\)"):
        import_source(source, tmp_path / "buf", pipeline, options=options, log=grow_when_writing_starts)
    assert len(rows_of(tmp_path / "buf")) == 32  # the scanned rows, none of the appended one

    source.write_bytes(original)  # the file as it was (a new mtime): the same command finishes the import
    result = import_source(source, tmp_path / "buf", pipeline, options=options, log=quiet)
    assert (result.resumed_from_row, result.rows_written) == (32, 32)
    import_source(source, tmp_path / "clean", pipeline, options=options, log=quiet)
    assert rows_of(tmp_path / "buf").equal(rows_of(tmp_path / "clean"))
    # other rows than those written are refused
    write_jsonl(source, toy_records(8)[::-1])
    with pytest.raises(SourceError, match=r"changed since it was imported"):
        import_source(source, tmp_path / "buf", pipeline, options=options, log=quiet)


def test_a_completion_that_is_only_eos_imports_as_the_buffer_stores_it(pipeline, collected_buffers, tmp_path):
    """The door stores a completion of one EOS token (response_text ""); import takes it back."""
    from rlhf_pipeline.dataio.export import export_buffer

    out = tmp_path / "rows.jsonl"
    export_buffer(collected_buffers["memmap"], out, "jsonl")
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    eos = char_tokenizer().eos_token_id
    lines[3].update(response_tokens=[eos], response_text="", response_log_probs=[-0.1], ref_log_probs=[-0.2],
                    kl=[0.1], token_rewards=[0.0])
    source = write_jsonl(tmp_path / "eos.jsonl", lines)
    create_store(tmp_path / "buf", "memmap", schema=StoreSchema(optional=WRITE_PATH_FIELDS)).close()
    import_source(source, tmp_path / "buf", pipeline, options=QUIET, log=quiet)
    rows = rows_of(tmp_path / "buf")
    assert rows["response_tokens"].row(3).tolist() == [eos] and rows["response_text"][3] == ""
    # text alone: an empty completion is EOS only, as the collector stores it
    text = write_jsonl(tmp_path / "text.jsonl", [{**r, "completion": ""} if i == 1 else r
                                                 for i, r in enumerate(toy_records(1))])
    import_source(text, tmp_path / "buf2", pipeline, options=QUIET, log=quiet)
    assert rows_of(tmp_path / "buf2")["response_tokens"].row(1).tolist() == [eos]


def test_plain_prompt_text_for_a_chat_template_pipeline_is_warned_about(pipeline, tmp_path):
    as_messages = toy_records(1)
    as_text = [{"prompt": r["messages"][0]["content"], **{k: v for k, v in r.items() if k != "messages"}}
               for r in as_messages]
    logged: list[str] = []
    import_source(write_jsonl(tmp_path / "text.jsonl", as_text), tmp_path / "a", pipeline, options=QUIET,
                  log=logged.append)
    warnings = [line for line in logged if "warning" in line]
    assert len(warnings) == 1 and "'prompt' is plain prompt text" in warnings[0] and "--messages" in warnings[0]
    logged.clear()
    import_source(write_jsonl(tmp_path / "chat.jsonl", as_messages), tmp_path / "b", pipeline, options=QUIET,
                  log=logged.append)
    assert not [line for line in logged if "warning" in line]


def _answer_last(records):
    """The rows as conversations ending with the assistant's answer (the SFT layout)."""
    return [{"messages": [*r["messages"], {"role": "assistant", "content": r["completion"]}],
             **{k: v for k, v in r.items() if k not in ("messages", "completion")}} for r in records]


def _conversational(records):
    """The rows as TRL's conversational prompt-completion: a prompt and a completion of messages."""
    return [{"prompt": r["messages"], "completion": [{"role": "assistant", "content": r["completion"]}],
             **{k: v for k, v in r.items() if k not in ("messages", "completion")}} for r in records]


@pytest.mark.parametrize("layout", [_answer_last, _conversational])
def test_an_answer_given_as_the_assistants_message_imports_as_the_same_completion(pipeline, tmp_path, layout):
    plain = toy_records(3)
    import_source(write_jsonl(tmp_path / "plain.jsonl", plain), tmp_path / "plain", pipeline, options=QUIET,
                  log=quiet)
    logged: list[str] = []
    result = import_source(write_jsonl(tmp_path / "chat.jsonl", layout(plain)), tmp_path / "chat", pipeline,
                           options=QUIET, log=logged.append)
    assert (result.completions, result.groups) == (12, 3)
    assert not [line for line in logged if "warning" in line]  # a prompt of messages is rendered, not plain text
    assert "completion=the " in logged[0] and "message of" in logged[0]
    assert rows_of(tmp_path / "chat").equal(rows_of(tmp_path / "plain"))  # the prompt rendered without the answer


@pytest.mark.parametrize("layout, edit, message", [
    (_answer_last, {"messages": [{"role": "user", "content": "1+1="}]},
     r"chat.jsonl line 3, column 'messages': expected the assistant's answer as the last message .* got a 'user'"),
    (_answer_last, {"messages": [{"role": "assistant", "content": "2"}]},
     r"chat.jsonl line 3, column 'messages': the assistant's answer is the only message"),
    (_conversational, {"completion": [{"role": "assistant", "content": "2"}, {"role": "user", "content": "?"}]},
     r"chat.jsonl line 3, column 'completion': expected the completion as one assistant message"),
    (_conversational, {"completion": "2"},
     r"chat.jsonl line 3, column 'completion': expected the completion as one assistant message"),
])
def test_an_answer_message_missing_from_a_later_record_is_refused_naming_it(pipeline, tmp_path, layout, edit, message):
    records = layout(toy_records(2))
    records[2].update(edit)
    with pytest.raises(SourceError, match=message):
        import_source(write_jsonl(tmp_path / "chat.jsonl", records), tmp_path / "buf", pipeline, options=QUIET,
                      log=quiet)
    assert not (tmp_path / "buf").exists()
    # a conversation that does not end with an answer, and no completion column: the options and the layout
    asked = [{"messages": r["messages"], "reward": r["reward"]} for r in toy_records(1)]
    with pytest.raises(SourceError, match=r"no completion column; name one with --completion .* or end each "
                                          r"record's messages with the assistant's answer"):
        import_source(write_jsonl(tmp_path / "asked.jsonl", asked), tmp_path / "buf", pipeline, options=QUIET,
                      log=quiet)


def test_a_stop_requested_before_the_write_pass_leaves_nothing_and_the_same_call_imports_all(pipeline, tmp_path):
    source = write_jsonl(tmp_path / "s.jsonl", toy_records(6))
    stop = threading.Event()
    stop.set()
    with pytest.raises(ImportStopped, match="after 0 rows"):
        import_source(source, tmp_path / "buf", pipeline, options=ImportOptions(show_progress=False, stop=stop),
                      log=quiet)
    assert not (tmp_path / "buf").exists()
    stop.clear()
    result = import_source(source, tmp_path / "buf", pipeline, options=ImportOptions(show_progress=False, stop=stop),
                           log=quiet)
    assert result.rows_written == len(rows_of(tmp_path / "buf")) == 6 * GROUP_SIZE
