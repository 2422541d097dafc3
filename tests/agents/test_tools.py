"""Tools: schemas from signatures, the parsers, and every way a call fails becoming an answer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlhf_pipeline.agents.environment import ToolCall
from rlhf_pipeline.agents.tools import (
    PARSERS,
    ToolBox,
    parse_deepseek,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parser_for_template,
)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: what to say
    """
    raise RuntimeError(reason)


RELEASED = threading.Event()  # set once a test is over: a call of ``stuck`` runs past any timeout till then


def stuck() -> str:
    """Returns once the test is over."""
    RELEASED.wait(60)
    return "awake"


def shout(text: str) -> str:
    """Repeats a text many times.

    Args:
        text: the text
    """
    return text * 100


async def lookup(key: str) -> dict:
    """Looks a key up.

    Args:
        key: the key
    """
    await asyncio.sleep(0)
    return {"key": key, "value": len(key)}


@pytest.fixture
def box():
    """A limit no loaded machine reaches for the quick tools (``stuck`` is given one of its own)."""
    box = ToolBox([multiply, explode, stuck, shout, lookup], timeout_s=60.0, max_output_chars=120,
                  max_calls_per_turn=3)
    RELEASED.clear()
    yield box
    RELEASED.set()
    box.close()


def test_schemas_come_from_signatures_and_docstrings(box):
    schema = box.schemas[0]["function"]
    assert schema["name"] == "multiply" and schema["description"] == "Multiplies two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor"}
    assert schema["parameters"]["required"] == ["a", "b"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="undocumented"):
        ToolBox([undocumented])
    with pytest.raises(ValueError, match="two tools"):
        ToolBox([multiply, multiply])


def test_hermes_parser():
    text = ('Let me compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}</tool_call>')
    first, second = parse_hermes(text)
    assert (first.name, dict(first.arguments), first.error) == ("multiply", {"a": 6, "b": 7}, None)
    assert first.raw.startswith("<tool_call>") and first.raw.endswith("</tool_call>")
    assert (second.name, dict(second.arguments)) == ("lookup", {"key": "x"})  # arguments as a JSON string
    assert parse_hermes("no calls here") == []


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "multiply", "arguments": {"a": 6,</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 6}}', "not closed"),  # cut at its length
    ('<tool_call>[1, 2]</tool_call>', "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "m", "arguments": [1]}</tool_call>', '"arguments" must be'),
    ('<tool_call>{"name": "m", "arguments": "{bad"}</tool_call>', "arguments are not valid JSON"),
])
def test_hermes_parser_marks_malformed_calls(text, error):
    (call,) = parse_hermes(text)
    assert call.error is not None and error in call.error


def test_mistral_parser_and_the_choice_by_template():
    calls = parse_mistral('[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 2, "b": 3}}, '
                          '{"name": "lookup", "arguments": {"key": "k"}}] trailing')
    assert [(c.name, dict(c.arguments)) for c in calls] == [("multiply", {"a": 2, "b": 3}), ("lookup", {"key": "k"})]
    (bad,) = parse_mistral("[TOOL_CALLS][{oops")
    assert "not valid JSON" in bad.error
    assert parse_mistral("plain answer") == []
    assert parser_for_template("{{ '<tool_call>' }}") is PARSERS["hermes"]
    assert parser_for_template("[TOOL_CALLS]") is PARSERS["mistral"]
    with pytest.raises(ValueError, match="PARSERS"):
        parser_for_template("{{ messages }}")


def test_llama3_json_parser_reads_calls_and_leaves_answers_alone():
    calls = parse_llama3_json('<|python_tag|>{"name": "multiply", "parameters": {"a": 2, "b": 3}}; '
                              '{"name": "lookup", "parameters": {"key": "k"}}')
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("multiply", {"a": 2, "b": 3}, None), ("lookup", {"key": "k"}, None)]
    assert parse_llama3_json("The product is 6.") == []  # an answer
    (cut,) = parse_llama3_json('{"name": "multiply", "parameters": {"a": 2')  # a turn cut at its length
    assert "not valid JSON" in cut.error
    (empty,) = parse_llama3_json("<|python_tag|> 6")
    assert "not followed by a JSON tool call" in empty.error
    (nameless,) = parse_llama3_json('{"parameters": {"a": 1}}')
    assert 'needs a "name"' in nameless.error
    assert parser_for_template("{{- '<|python_tag|>' + tool_call.name }}") is PARSERS["llama3_json"]


def test_deepseek_parser_reads_fenced_arguments_and_marks_broken_calls():
    def call(name: str, args: str, closed: bool = True) -> str:
        return (f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
                + ("<｜tool▁call▁end｜>" if closed else ""))

    text = "<｜tool▁calls▁begin｜>" + call("multiply", '{"a": 2, "b": 3}') + call("lookup", '{"key"') + \
        "<｜tool▁calls▁end｜>"
    good, bad = parse_deepseek(text)
    assert (good.name, dict(good.arguments), good.error) == ("multiply", {"a": 2, "b": 3}, None)
    assert bad.name == "lookup" and "not valid JSON" in bad.error
    (unclosed,) = parse_deepseek("<｜tool▁calls▁begin｜>" + call("multiply", '{"a": 2}', closed=False))
    assert "not closed" in unclosed.error
    (garbled,) = parse_deepseek("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>multiply(2, 3)")
    assert "does not follow" in garbled.error
    assert parse_deepseek("The product is 6.") == []
    assert parser_for_template("{{'<｜tool▁calls▁begin｜>'}}") is PARSERS["deepseek"]


def test_good_calls_answer_with_the_result(box):
    answers = box.run([ToolCall("multiply", {"a": 6, "b": 7}, ""), ToolCall("lookup", {"key": "abc"}, "")])
    assert answers == [{"role": "tool", "name": "multiply", "content": "42"},
                       {"role": "tool", "name": "lookup", "content": '{"key": "abc", "value": 3}'}]
    assert box.metrics["calls"] == box.metrics["ok"] == 2 and box.errors() == 0


@pytest.mark.parametrize("call, metric, says", [
    (ToolCall("", {}, "<tool_call>{", "the tool call is not valid JSON"), "malformed", "not valid JSON"),
    (ToolCall("divide", {"a": 1}, ""), "unknown_tool", "there is no tool 'divide'"),
    (ToolCall("multiply", {"a": 1}, ""), "bad_arguments", "missing a required argument: 'b'"),
    (ToolCall("multiply", {"a": 1, "b": 2, "c": 3}, ""), "bad_arguments", "unexpected keyword argument 'c'"),
    (ToolCall("multiply", {"a": "x", "b": None}, ""), "raised", "multiply raised TypeError"),
    (ToolCall("explode", {"reason": "boom"}, ""), "raised", "explode raised RuntimeError: boom"),
])
def test_every_failure_is_an_error_answer_and_a_count(box, call, metric, says):
    (answer,) = box.run([call])
    assert answer["role"] == "tool" and answer["content"].startswith("Error: ") and says in answer["content"]
    assert box.metrics[metric] == 1 and box.metrics["calls"] == 1 and box.metrics["ok"] == 0
    assert box.errors() == 1


def test_a_call_past_its_timeout_is_an_error_answer_and_a_count(box):
    box.timeout_s = 0.1  # stuck returns once the test is over: past this limit on any machine
    (answer,) = box.run([ToolCall("stuck", {}, "")])
    assert answer == {"role": "tool", "name": "stuck", "content": "Error: stuck took longer than 0.1s"}
    assert box.metrics["timeout"] == 1 and box.metrics["calls"] == 1 and box.errors() == 1


def test_outputs_are_truncated_and_calls_past_the_limit_are_not_run(box):
    answers = box.run([ToolCall("shout", {"text": "ab"}, "")] * 2 + [ToolCall("multiply", {"a": 1, "b": 1}, "")]
                      + [ToolCall("multiply", {"a": 2, "b": 2}, "")])
    assert answers[0]["content"] == "ab" * 60 + "... [80 more characters cut]"
    assert answers[2]["content"] == "1"
    assert answers[3]["content"].startswith("Error: only 3 tool calls")
    assert box.metrics["truncated_output"] >= 2 and box.metrics["over_call_limit"] == 1 and box.metrics["calls"] == 4


def test_run_counted_says_how_many_calls_failed(box):
    answers, errors = box.run_counted([ToolCall("multiply", {"a": 2, "b": 3}, ""), ToolCall("nope", {}, "")])
    assert [a["content"][:6] for a in answers] == ["6", "Error:"] and errors == 1


def test_the_calculator_ends_on_repeated_tool_errors_and_nudges_a_bounded_number_of_times():
    from rlhf_pipeline.agents.calculator import CalculatorEnv, product_tasks
    from rlhf_pipeline.agents.environment import ModelTurn
    from rlhf_pipeline.schema import TerminationReason

    task = product_tasks(1, seed=5)[0]
    env = CalculatorEnv(max_tool_errors=2, nudges=1)
    env.reset(task)
    bad = (ToolCall("divide", {}, ""),)
    assert not env.step(ModelTurn(0, "", bad)).done
    result = env.step(ModelTurn(1, "", bad))
    assert result.done and result.reason is TerminationReason.TOOL_ERROR and result.reward == 0.0
    env.reset(task)
    assert env.step(ModelTurn(0, "no idea")).messages[0]["content"].startswith("Use the multiply tool")
    final = env.step(ModelTurn(1, f"it is {task['answer']}"))
    assert final.done and final.reward == 1.0 and final.reason is TerminationReason.ENV_DONE
    env.toolbox.close()


def test_the_calls_of_a_turn_run_at_the_same_time_and_answer_in_order():
    """Each call waits at a barrier for the others: run one after another, the first would time out
    waiting (and the turn be answered with errors); run together, all pass it."""
    barrier = threading.Barrier(3, timeout=5.0)

    def meet(tag: str) -> str:
        """Waits for the other calls of the turn.

        Args:
            tag: returned as the answer
        """
        barrier.wait()
        return tag

    box = ToolBox([meet, multiply], timeout_s=10.0, max_workers=3)
    assert box.run([ToolCall("multiply", {"a": 2, "b": 3}, "")])[0]["content"] == "6"
    # one thread is idle now and the turn has three calls: two new threads, not one call after another
    answers, errors = box.run_counted([ToolCall("meet", {"tag": t}, "") for t in ("a", "b", "c")])
    assert errors == 0 and [a["content"] for a in answers] == ["a", "b", "c"]
    answers, errors = box.run_counted([ToolCall("meet", {"tag": t}, "") for t in ("d", "e", "f")])  # and again
    box.close()
    assert errors == 0 and [a["content"] for a in answers] == ["d", "e", "f"]


def test_a_slow_call_times_out_alone_while_the_turns_other_calls_answer():
    release = threading.Event()

    def slow() -> str:
        """Blocks until released."""
        release.wait(60)
        return "late"

    def quick() -> str:
        """Answers at once."""
        return "quick"

    # a limit the quick call meets on a loaded machine; the slow one returns only once the test is over
    box = ToolBox([slow, quick], timeout_s=5.0, max_workers=2)
    try:
        answers, errors = box.run_counted([ToolCall("slow", {}, ""), ToolCall("quick", {}, "")])
    finally:
        release.set()
        box.close()
    assert errors == 1 and answers[0]["content"] == "Error: slow took longer than 5.0s"
    assert answers[1]["content"] == "quick" and box.metrics["timeout"] == 1 and box.metrics["ok"] == 1
