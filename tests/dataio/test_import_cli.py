"""``rlhf-pipeline import`` as a command: argument errors before heavy imports, advice that holds."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from dataio_setup import DEFAULT_PIPELINE, REPO, SMALL

from rlhf_pipeline.cli.main import main


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def toy_rows(groups: int, group_size: int = 4):
    return [{"messages": [{"role": "user", "content": f"{g % 10}+1="}], "group_id": f"g{g}", "completion": str(g % 10 + k),
             "reward": float(k == 1), "log_probs": [-0.5] * (len(str(g % 10 + k)) + 1)}
            for g in range(groups) for k in range(group_size)]


def test_a_missing_source_is_reported_before_torch_is_imported(tmp_path):
    code = ("import sys; from rlhf_pipeline.cli.main import main; "
            f"rc = main(['import', {str(tmp_path / 'nope.jsonl')!r}, {str(tmp_path / 'buf')!r}, "
            f"'--pipeline', {str(DEFAULT_PIPELINE)!r}]); print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "nope.jsonl' does not exist" in done.stderr


def test_a_new_buffer_named_like_a_zip_is_refused_before_anything_is_read_or_made(tmp_path, capsys):
    """A store an import makes is one it appends to: named .zip, a memmap one was a directory that read as no
    zip, and a Zarr one was refused only after the whole source had been checked."""
    source = write_jsonl(tmp_path / "rows.jsonl", toy_rows(2))
    assert main(["import", str(source), str(tmp_path / "rows.zip"), "--pipeline", str(DEFAULT_PIPELINE)]) == 2
    err = capsys.readouterr().err
    assert "a zipped store is read-only" in err and f"convert DIR {tmp_path / 'rows.zip'} --to zarr" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_group_size_advice_in_a_run_does_not_suggest_set(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    source = write_jsonl(tmp_path / "threes.jsonl", toy_rows(2, group_size=3))
    assert main(["import", str(source), str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "takes groups of 4" in err and "settings.json fixes it" in err and "--set" not in err
    assert main(["import", str(source), str(tmp_path / "store"), "--quiet", "--pipeline", str(DEFAULT_PIPELINE),
                 *[a for s in SMALL for a in ("--set", s)]]) == 2
    assert "--set group_size=3" in capsys.readouterr().err


def test_an_import_into_a_run_refuses_a_pipeline_other_than_the_runs_copy(tiny_run, tmp_path, capsys):
    """--pipeline replaced the run's copy of its pipeline file: another pipeline's tokenizer and write path
    shaped rows its learner trains on beside its own (tool_use.py's into a default.py run got as far as
    its advantages). The run's own file is still taken; nothing is written for another."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = sorted(p.name for p in (run / "buffer").iterdir())
    source = write_jsonl(tmp_path / "rows.jsonl", toy_rows(2))
    other = REPO / "pipelines" / "tool_use.py"
    assert main(["import", str(source), str(run), "--quiet", "--pipeline", str(other)]) == 2
    assert (f"--pipeline {other} differs from the copy run {run} was started with ({run / 'pipeline.py'}), "
            "which rebuilds its model, tokenizer and write path"
            in capsys.readouterr().err)
    assert sorted(p.name for p in (run / "buffer").iterdir()) == before
    assert main(["import", str(source), str(run), "--quiet", "--pipeline", str(run / "pipeline.py")]) == 0


def test_a_runs_export_imported_into_a_run_is_numbered_in_the_imports_shard(tiny_run, tmp_path, capsys):
    """An export keeps group and trajectory ids; imported into a run (its own, or any run whose collector 0
    counted from 0 too) they were kept, so the import's shard repeated collector 0's ids: `filter --groups`
    judged two groups as one and `show` joined two trajectories. They are numbered again in the import's
    shard's range, each group and trajectory whole."""
    from rlhf_pipeline.schema.ids import collector_index_of
    from rlhf_pipeline.storage import open_buffer

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    exported = tmp_path / "rows.jsonl"
    assert main(["export", str(run), str(exported), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["import", str(exported), str(run)]) == 0
    assert "numbered again in the shard's range" in capsys.readouterr().err
    rows = {}
    for shard in ("shard-0000", "shard-9000"):
        with open_buffer(str(run / "buffer" / shard), mode="r") as store:
            rows[shard] = store.read(torch.arange(len(store)))
    own, imported = rows["shard-0000"], rows["shard-9000"]
    assert imported["response_tokens"].equal(own["response_tokens"])  # the same rows, in the same order
    for key in ("group_id", "trajectory_id"):
        assert set(collector_index_of(imported[key]).tolist()) == {9000}, key
        # one new id for each old one and back: every group and trajectory whole, none joined
        pairs = set(zip(own[key].tolist(), imported[key].tolist()))
        assert len(pairs) == len(set(own[key].tolist())) == len(set(imported[key].tolist())), key
    assert main(["filter", str(run), "--where", "reward >= 0", "--groups", "--dry-run"]) == 0
    groups = len(set(own["group_id"].tolist()))
    assert f"of {2 * groups} groups" in capsys.readouterr().out


# ====================================================================== records the first one does not speak for
def _set_small():
    return [a for s in SMALL for a in ("--set", s)]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A buffer already holding two imported groups: a refused import must leave them as they are."""
    root = tmp_path_factory.mktemp("stored")
    source = write_jsonl(root / "good.jsonl", toy_rows(2))
    assert main(["import", str(source), str(root / "buf"), "--quiet", "--pipeline", str(DEFAULT_PIPELINE),
                 *_set_small()]) == 0
    return root / "buf"


def _later_rows_with_log_probs():
    rows = toy_rows(2)
    for row in rows[:4]:
        del row["log_probs"]
    for row in rows[4:]:  # bad values too: positive log-probs, never checked while the column was dropped
        row["log_probs"] = [0.5] * len(row["log_probs"])
    return rows


def _edited(index: int, **changes):
    rows = toy_rows(2)
    rows[index].update(changes)
    return rows


def _without(index: int, column: str):
    rows = toy_rows(2)
    del rows[index][column]
    return rows


@pytest.mark.parametrize("rows, message", [
    # a column on later records only was dropped from every record without a word
    (_later_rows_with_log_probs(),
     r"bad.jsonl line 5: column 'log_probs' is missing from \S*bad.jsonl line 1 \(the first record\), which decides "
     r"the columns an import reads, so it would be dropped from every record; give it on every record, or leave it "
     r"out with --ignore-column log_probs$"),
    (_without(5, "log_probs"), r"bad.jsonl line 6, column 'log_probs': missing \(the first record has this column"),
    (_without(6, "group_id"), r"bad.jsonl line 7, column 'group_id': missing \(the first record has this column"),
    # a prompt of 10,002 characters (tokens, with the char tokenizer) for a model of 256 positions
    (_edited(2, messages=[{"role": "user", "content": "1" * 10_000 + "+1"}]),
     r"bad.jsonl line 3: its prompt \(\d+ tokens\) and completion \(2 tokens\) make \d+ tokens, more than the 256 "
     r"positions of the pipeline's model \(max_position_embeddings\)"),
    # lone surrogates (JSON "\ud800"): a 35-line tokenizer traceback, or the wrong line named
    (_edited(4, messages=[{"role": "user", "content": "\ud800+1="}]),
     r"bad.jsonl line 5, column 'messages': holds a lone surrogate \('\\ud800' at character 0\)"),
    ([{**{k: v for k, v in row.items() if k != "messages"}, "prompt": "1+\udfff" if i == 6 else "1+1="}
      for i, row in enumerate(toy_rows(2))],
     r"bad.jsonl line 7, column 'prompt': holds a lone surrogate \('\\udfff' at character 2\)"),
    (_edited(3, completion="\ud83d"), r"bad.jsonl line 4, column 'completion': holds a lone surrogate"),
    (_edited(7, group_id="g\ud800"), r"bad.jsonl line 8, column 'group_id': holds a lone surrogate"),
    # the chat template's own error: a traceback, and line 1 named for any record
    (_edited(5, messages=[{"role": "bogus", "content": "1+1="}]),
     r"bad.jsonl line 6, column 'messages': the tokenizer's chat template failed: unknown chat role: bogus"),
])
def test_a_bad_record_is_refused_in_one_line_and_nothing_stored_is_lost(stored, tmp_path, capsys, rows, message):
    buffer = tmp_path / "buf"
    shutil.copytree(stored, buffer)
    capsys.readouterr()
    before = rows_in(buffer)
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    assert main(["import", str(source), str(buffer), "--quiet", "--pipeline", str(DEFAULT_PIPELINE),
                 *_set_small()]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(message, err.strip().removeprefix("rlhf-pipeline import: error: ")), err
    assert rows_in(buffer) == before
    assert not (buffer / "imports" / "bad.jsonl").exists() and len(list((buffer / "imports").iterdir())) == 1


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_column_only_in_a_later_data_file_is_refused(tmp_path, capsys, kind):
    """A directory of data files: the first file decides the columns, as its first record does."""
    data = tmp_path / "data"
    data.mkdir()
    rows = _later_rows_with_log_probs()
    if kind == "jsonl":
        write_jsonl(data / "train-0.jsonl", rows[:4])
        write_jsonl(data / "train-1.jsonl", rows[4:])
        where = "line 1"
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        for i, part in enumerate((rows[:4], rows[4:])):
            pq.write_table(pa.Table.from_pylist(part), data / f"train-{i}.parquet")
        where = "row 0"
    assert main(["import", str(data), str(tmp_path / "buf"), "--quiet", "--pipeline", str(DEFAULT_PIPELINE),
                 *_set_small()]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"train-1.{kind} {where}: column 'log_probs' is missing from \S*train-0.{kind} {where}", err), err
    assert not (tmp_path / "buf").exists()


def rows_in(buffer):
    from rlhf_pipeline.storage import open_store

    with open_store(str(buffer), mode="r") as store:
        batch = store.read(torch.arange(len(store)))
    return {name: batch[name].tolist() if hasattr(batch[name], "tolist") else list(batch[name])
            for name in ("group_id", "trajectory_id", "reward", "response_text")}


def test_a_buffer_given_by_its_runs_name_needs_home_and_an_ambiguous_name_is_refused(tiny_run, tmp_path, capsys,
                                                                                    monkeypatch):
    """BUFFER as a run's name: with --home, the run of that name there (none there: refused); without,
    a new store in this directory, as always, unless a run of that name is under the default home, when
    the name could be either and is refused naming both. Nothing is written by a refusal."""
    home = tmp_path / "home"
    shutil.copytree(tiny_run, home / "exp")
    source = write_jsonl(tmp_path / "rows.jsonl", toy_rows(1))
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)

    assert main(["import", str(source), "other", "--home", str(home)]) == 2
    assert f"BUFFER other: no run of that name is under --home {home}" in capsys.readouterr().err
    monkeypatch.setenv("RLHF_PIPELINE_HOME", str(home))
    assert main(["import", str(source), "exp", "--pipeline", str(DEFAULT_PIPELINE)]) == 2
    err = capsys.readouterr().err
    assert f"BUFFER exp could be a new store in this directory or the run {home / 'exp'}" in err, err
    assert "give ./exp for the store" in err
    assert list(workdir.iterdir()) == [] and not (home / "exp" / "imports").exists()

    assert main(["import", str(source), "exp", "--home", str(home), "--quiet"]) == 0
    assert (home / "exp" / "imports").is_dir()  # the run's import record: the rows went into its buffer
    assert list(workdir.iterdir()) == []
