from __future__ import annotations

import json

import pytest

from rlhf_pipeline.collect.prompts import PromptError, PromptRecord, PromptSource, load_jsonl, make_prompt, validate_prompts


def test_records_from_dicts_and_strings(tiny):
    _, tok = tiny
    chat = make_prompt({"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "id": 7})
    text = make_prompt({"prompt": "Q: 1+1=", "answer": "2"})
    bare = make_prompt("just text")
    assert chat.fields == {"answer": "2"} and chat.prompt_id == "7"
    assert tok.decode(chat.render(tok)) == "<|user|>1+1=<|assistant|>"
    assert chat.display_text(tok) == "<|user|>1+1=<|assistant|>"
    assert tok.decode(text.render(tok)) == "Q: 1+1=" and text.display_text(tok) == "Q: 1+1="
    assert bare.text == "just text"


@pytest.mark.parametrize("bad, match", [
    ({"answer": "2"}, "exactly one of 'messages'"),
    ({"messages": [], "answer": "2"}, "non-empty list"),
    ({"messages": [{"role": "user"}], "answer": "2"}, r"messages\[0\]"),
    ({"text": "", "answer": "2"}, "non-empty string"),
    ({"text": "x", "prompt": "y"}, "both 'prompt' and 'text'"),
])
def test_malformed_records_are_rejected(bad, match):
    with pytest.raises(PromptError, match=match):
        make_prompt(bad)


def test_missing_reward_field_names_the_field_and_record():
    with pytest.raises(PromptError, match=r"prompt 1: missing field\(s\) \['answer'\]"):
        validate_prompts([{"text": "a", "answer": "1"}, {"text": "b"}], required_fields=("answer",))


def test_jsonl_loader(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2="}], "answer": "4"}) + "\n\n"
                    + json.dumps({"prompt": "3+3=", "answer": "6"}) + "\n")
    records = load_jsonl(path, required_fields=("answer",))
    assert [r.fields["answer"] for r in records] == ["4", "6"]
    path.write_text('{"prompt": "a", "answer": "1"}\n{not json}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: not valid JSON"):
        load_jsonl(path)
    with pytest.raises(PromptError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_source_resumes_without_skipping_or_repeating():
    records = [PromptRecord(text=str(i)) for i in range(7)]
    full = PromptSource(records, seed=3)
    expected = [r.text for r in full.next_batch(20)]
    assert sorted(expected[:7]) == sorted(expected[7:14]) == [str(i) for i in range(7)]
    assert expected[:7] != expected[7:14]  # reshuffled per epoch

    first = PromptSource(records, seed=3)
    head = [r.text for r in first.next_batch(9)]
    resumed = PromptSource(records, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert head + [r.text for r in resumed.next_batch(11)] == expected

    with pytest.raises(PromptError, match="same prompts"):
        PromptSource(records[:5], seed=3).load_state_dict(first.state_dict())


def test_task_source_cycles_like_prompt_source_and_resumes_exactly():
    from rlhf_pipeline.collect.prompts import TaskSource

    tasks = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    source = TaskSource(tasks, seed=3)
    first = [t["answer"] for t in source.next_batch(7)]  # crosses into the second epoch
    assert sorted(first[:5]) == ["0", "1", "2", "3", "4"]
    state = source.state_dict()
    rest = [t["answer"] for t in source.next_batch(6)]
    again = TaskSource(tasks, seed=3)
    again.load_state_dict(state)
    assert [t["answer"] for t in again.next_batch(6)] == rest
    # the order an uninterrupted prompt source walks, over the same records
    prompts = PromptSource([{"prompt": t["question"], "answer": t["answer"]} for t in tasks], seed=3)
    assert [r.fields["answer"] for r in prompts.next_batch(13)] == first + rest
    handed = again.next_batch(1)[0]
    handed["answer"] = "edited"  # an environment editing its task changes nothing in the source
    assert all(t["answer"] != "edited" for t in again.tasks)
    with pytest.raises(PromptError, match="missing field"):
        TaskSource([{"question": "q"}], required_fields=("answer",))
    with pytest.raises(PromptError, match="same tasks"):
        TaskSource(tasks[:4], seed=3).load_state_dict(state)
