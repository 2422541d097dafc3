"""``inspect --verify`` names the groups of a real buffer whose rows hold token ids the model cannot
embed (``storage/token_ids.py``): checked against a run's model (its newest published weights) or
``--vocab-size``; such a row is intact on disk, so the checksums alone said "no damage found"."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_batch

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.coordination.weights import publish_weights
from rlhf_pipeline.models import tiny_model_and_tokenizer
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.storage.token_ids import bad_groups
from rlhf_pipeline.storage import open_store

GROUP = 4


def _planted(path, vocab_size: int, backend: str = "memmap") -> None:
    """Three groups of in-vocabulary rows, then group 3 with id 10**6 in row 13's response and 150 in
    row 14's prompt, then two good groups: 24 rows over several storage units. (A negative id is
    refused at the door, ``schema/batch.py``.)"""
    options = {"segment_rows": 8} if backend == "memmap" else {}
    with create_store(path, backend, **options) as store:
        store.append(make_batch(3, GROUP, vocab_size=vocab_size))
        bad = make_batch(1, GROUP, seed=1, first_group_id=3, first_trajectory_id=12, vocab_size=vocab_size)
        responses, prompts = bad["response_tokens"], bad["prompt_tokens"]
        responses.values[int(responses.lengths()[0])] = 10**6  # row 13's first response token
        prompts.values[int(prompts.lengths()[:2].sum())] = 150  # row 14's first prompt token
        store.append(bad)
        store.append(make_batch(2, GROUP, seed=2, first_group_id=4, first_trajectory_id=16, vocab_size=vocab_size))


@pytest.mark.parametrize("backend", ["memmap", "zarr"])
def test_the_groups_holding_ids_outside_the_vocabulary_are_found(tmp_path, backend):
    _planted(tmp_path / "buffer", 102, backend)
    with open_store(tmp_path / "buffer") as store:
        (group,) = bad_groups(store, 102)
        assert (group.group_id, group.rows, group.row, group.field, group.token) == \
               (3, (13, 14), 13, "response_tokens", 10**6)
        assert bad_groups(store, 151)[0].rows == (13,)
        assert bad_groups(store, 10**6 + 1) == []


def test_inspect_verify_of_a_run_checks_token_ids_against_its_models_vocabulary(tmp_path, capsys):
    model, tok = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)
    vocab = model.config.vocab_size
    run = tmp_path / "run"
    (run / "buffer").mkdir(parents=True)
    (run / "settings.json").write_text("{}")
    publish_weights(run, model.state_dict(), 0)
    _planted(run / "buffer" / "shard-0000", vocab)
    # before: the checksums alone find nothing wrong
    assert main(["inspect", str(run / "buffer"), "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "no damage found" in out and "token ids not checked: a bare buffer: pass --vocab-size" in out
    assert main(["inspect", str(run), "--verify", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"group 3: rows 13, 14 hold token ids outside the model's vocabulary of {vocab} " \
           f"(row 13 response_tokens: 1000000): a learner cannot embed them" in out
    assert "shard-0000" in out and "model.embed_tokens.weight" in out
    assert main(["inspect", str(run / "buffer"), "--verify", "--quiet", "--json", "--vocab-size", str(vocab)]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert not report["ok"] and len(report["problems"]) == 1 and report["checked"]["rows' token ids"] == 24
    assert main(["inspect", str(run / "buffer"), "--verify", "--quiet", "--vocab-size", "151"]) == 1
    assert "group 3: row 13 holds token ids outside the model's vocabulary of 151" in capsys.readouterr().out


def test_a_vocabulary_size_without_verify_or_below_one_is_refused_in_one_line(tmp_path, capsys):
    _planted(tmp_path / "buffer", 102)
    for flags in (["--vocab-size", "102"], ["--verify", "--vocab-size", "0"], ["--verify", "--vocab-size", str(2**40)]):
        assert main(["inspect", str(tmp_path / "buffer"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--vocab-size" in err


def test_repair_names_the_groups_and_the_selection_without_them_that_a_learner_samples(tmp_path, capsys):
    import shlex

    from rlhf_pipeline.storage import open_buffer

    _planted(tmp_path / "buffer", 102)
    assert main(["repair", str(tmp_path / "buffer"), "--quiet"]) == 0  # no vocabulary: nothing to say of the ids
    capsys.readouterr()
    assert main(["repair", str(tmp_path / "buffer"), "--quiet", "--vocab-size", "102"]) == 1
    out = capsys.readouterr().out
    assert "token ids checked against a vocabulary of 102" in out
    assert "NOT RECOVERABLE: group 3: rows 13, 14 hold token ids outside the model's vocabulary of 102 " \
           "(row 13 response_tokens: 1000000): rows cannot be taken out of the middle of a store" in out
    command = out.split("to train on the other rows offline: ")[1].split(", then rlhf-pipeline replay")[0]
    words = shlex.split(command.replace("DST", str(tmp_path / "kept")))
    assert words[:2] == ["rlhf-pipeline", "filter"] and main(words[1:]) == 0
    with open_buffer(tmp_path / "kept") as kept:  # what replay --buffer reads: every row but group 3's
        rows = kept.read(torch.arange(len(kept)), fields=("group_id", "prompt_tokens", "response_tokens"))
    assert len(rows) == 20 and 3 not in rows["group_id"].tolist()
    assert all(int(rows[f].values.max()) < 102 for f in ("prompt_tokens", "response_tokens"))


def test_repair_reports_damage_that_keeps_rows_from_being_read_and_notes_the_ids_unchecked(tmp_path, capsys):
    """A segment file cut short outside this library, in one shard of two: repair reports it as not
    recoverable, as it does without a vocabulary; with one (a run's, or --vocab-size), its check of the
    ids read the rows and the whole command was one error line instead of the report. Now the report,
    and a note on the damaged shard's (every shard's quoted the damage of one)."""
    damaged, whole = tmp_path / "buffer" / "shard-0000", tmp_path / "buffer" / "shard-0001"
    _planted(damaged, 102)
    with create_store(whole, "memmap") as store:
        store.append(make_batch(1, GROUP, vocab_size=102))
    cut = damaged / "seg-00000000" / "prompt_tokens.values"
    cut.write_bytes(cut.read_bytes()[:10])
    assert main(["repair", str(tmp_path / "buffer"), "--quiet", "--vocab-size", "102"]) == 1
    out = capsys.readouterr().out
    assert f"NOT RECOVERABLE: {cut} holds 10 bytes" in out, out
    damaged_report, whole_report = out.split(f"{whole} (memmap)")
    unchecked = "note: token ids not checked: its rows cannot be read while the damage above stays"
    assert unchecked in damaged_report and "token ids" not in whole_report, out


def test_repair_of_a_run_names_the_branch_from_the_newest_checkpoint_before_the_bad_rows(tmp_path, capsys):
    from rlhf_pipeline.learn.checkpoint import CheckpointManager, Progress

    model, _ = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, num_heads=4)
    vocab = model.config.vocab_size
    run = tmp_path / "run"
    (run / "buffer").mkdir(parents=True)
    (run / "settings.json").write_text("{}")
    publish_weights(run, model.state_dict(), 0)
    _planted(run / "buffer" / "shard-0000", vocab)  # group 3 (rows 12-15) holds the bad ids, from row 13
    checkpoints = CheckpointManager(run / "checkpoints", keep_last=3)
    for step, rows in ((1, 8), (2, 12), (3, 16)):
        checkpoints.save(Progress(seed=0, step=step, policy_version=step), {"w": torch.zeros(1)},
                         record={"buffer_rows": {"shard-0000": rows}})
    assert main(["repair", str(run), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"group 3: rows 13, 14 hold token ids outside the model's vocabulary of {vocab}" in out
    assert f"rlhf-pipeline branch {run} --from-step 2 run-from-2, then rlhf-pipeline run PIPELINE.py --home " \
           f"{tmp_path} --run-name run-from-2" in out
