"""Edges of a chat output's text as a client sees it, whole and streamed: an output that is
a bare `<think>` (max_tokens right after it), and an empty output under tools without a
reasoning parser (its content "" in the stream as in the whole answer)."""

import pytest

from deployments.reasoning import ReasoningSplit, ReasoningStream
from tests.unit.test_reasoning import TOOLS, whole_and_streamed


@pytest.mark.parametrize("text", ["<think>", "\n<think>", " <think>"])
def test_an_output_cut_right_after_its_opening_think_has_an_empty_reasoning(text):
    """The `<think>` that opens the output is dropped (with the whitespace before it) even
    when nothing follows it: the reasoning is "", not the tag's text."""
    assert ReasoningSplit("deepseek_r1").split(text) == ("", None)
    for size in (1, len(text)):
        stream, reasoning = ReasoningStream(), ""
        for start in range(0, len(text), size):
            thought, said = stream.feed(text[start:start + size])
            assert said == ""
            reasoning += thought
        assert reasoning + stream.finish()[0] == ""
    whole, deltas = whole_and_streamed(text)
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("", None)
    assert not any(d["delta"].get("reasoning") for d in deltas)


def test_an_empty_output_under_tools_streams_its_empty_content():
    """Without a reasoning parser the whole answer's content is "" (not null): the stream,
    whose role chunk carried no content under tools, sends that "" before its end."""
    whole, deltas = whole_and_streamed("", parser=None, tools=TOOLS)
    assert whole["message"]["content"] == ""
    contents = [d["delta"]["content"] for d in deltas if "content" in d["delta"]]
    assert "" in contents and not any(contents)
    assert deltas[-1]["finish_reason"] == whole["finish_reason"]
