"""vLLM 0.32's `qwen3` parser drops the tags its grammar absorbs (vllm/parser/qwen3.py: the
transitions REASONING -> REASONING on THINK_START and CONTENT -> CONTENT on THINK_END emit
nothing): every `<think>` inside the reasoning (the whitespace before an opening one kept),
every `</think>` in the content, a call's text included (its tool parser reads the content
without them); usage counts no token of a dropped `<think>`, nor of a `</tool_call>` inside
the reasoning (its text kept, its id's token not counted). The expected splits and counts
are vLLM 0.32's own, read off its parser on the tokenizer of test_qwen3_tool_end. Its
stream drops a `</think>` only where the reasoning ended in the same delta; here the stream
adds up to the whole answer, which drops them all. `deepseek_r1` keeps them (its whole
split partitions at the first `</think>`)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.reasoning import ReasoningSplit, ThinkTokens
from tests.unit.test_qwen3_tool_end import qwen_tokenizer
from tests.unit.test_reasoning import TOOLS, accumulated, whole_and_streamed

DROPS = [  # an output's text: its (reasoning, content) under vLLM 0.32's qwen3
    ("a</think>b</think>c", ("a", "bc")),
    ("a</think>b</think>", ("a", "b")),
    ("a</think></think>", ("a", None)),  # the content empty: null
    ("<think>a<think>b</think>c<think>d", ("ab", "c<think>d")),  # the content's is text
    (" \n<think>a</think>b", (" \na", "b")),  # the whitespace before `<think>` is reasoning
    ("a<tool_call>b</think>c", ("a", "<tool_call>bc")),  # after an implicit end too
    ("</<think>think>x", ("</think>x", None)),  # a dropped tag's neighbours make no tag
    ("a</think><</think>/think>", ("a", "</think>")),
    ("a</think>b</thi", ("a", "b</thi")),  # a tag cut short is text
]
TAGS = ("<think>", "</think>", "<tool_call>")


def engine_split(text: str) -> tuple[str, str | None]:
    """vLLM 0.32's qwen3 grammar read a character at a time (its lexer's tags, left to
    right): in the reasoning `<think>` is dropped and `</think>` or `<tool_call>` ends it
    (the latter kept, the content's); in the content `</think>` is dropped."""
    parts, state, at = {"reasoning": "", "content": ""}, "reasoning", 0
    while at < len(text):
        tag = next((t for t in TAGS if text.startswith(t, at)), None)
        if tag is None or (state, tag) in (("content", "<think>"), ("content", "<tool_call>")):
            parts[state], at = parts[state] + text[at], at + 1
            continue
        if state == "reasoning" and tag != "<think>":
            state = "content"
            parts[state] += "" if tag == "</think>" else tag
        at += len(tag)
    return parts["reasoning"], parts["content"] or None


@pytest.mark.parametrize("text, split", DROPS)
def test_qwen3_drops_the_tags_its_grammar_absorbs_whole_and_streamed(text, split):
    assert ReasoningSplit("qwen3").split(text) == split == engine_split(text)
    for size in (1, 2, 3, 7, max(len(text), 1)):
        stream, reasoning, content = ReasoningSplit("qwen3").stream(), "", ""
        for start in range(0, len(text), size):
            thought, said = stream.feed(text[start:start + size])
            reasoning, content = reasoning + thought, content + said
        held, tail = stream.finish()
        assert (reasoning + held, (content + tail) or None) == split, (text, size)


def test_deepseek_r1_keeps_them():
    """vLLM's basic parser partitions its text at the first `</think>`: the rest is kept."""
    assert ReasoningSplit("deepseek_r1").split("a</think>b</think>c") == ("a", "b</think>c")
    assert ReasoningSplit("deepseek_r1").split("<think>a<think>b") == ("a<think>b", None)


def test_a_end_of_thinking_cut_across_the_contents_deltas_is_held_and_dropped():
    stream = ReasoningSplit("qwen3").stream()
    assert stream.feed("a</think>b</th") == ("a", "b")
    assert stream.feed("ink>c<") == ("", "c")
    assert stream.feed("/") == ("", "")
    assert stream.finish() == ("", "</")  # never came whole: text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<tool_call>", "<", "</", "<th",
                                 "ink>", "think>", "/think>", "a", " ", "\n"]), max_size=10))
def test_the_split_is_the_grammars_for_every_output(pieces):
    text = "".join(pieces)
    assert ReasoningSplit("qwen3").split(text) == engine_split(text)


def test_a_calls_end_of_thinking_is_dropped_before_the_tool_parser_reads_it():
    """vLLM's whole answer: the reasoning parser's content, without its `</think>`, is what
    the tool parser reads (three characters a token: the tags cut across deltas)."""
    call = '<tool_call>{"name": "n</think>ow", "arguments": {}}</tool_call>'
    whole, deltas = whole_and_streamed("Let me see.</think>" + call, parser="qwen3",
                                       tools=TOOLS)
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["now"]
    assert [c["function"]["name"] for d in deltas for c in d["delta"].get("tool_calls", [])] \
        == ["now"]
    whole, deltas = whole_and_streamed("a</think>b</think>c", parser="qwen3")
    assert whole["message"]["content"] == "bc" == accumulated(deltas, "content")


@pytest.mark.parametrize("text, count", [  # vLLM 0.32's count_reasoning_tokens
    ("<think>hello<think>world</think>x", 3),
    ("\n<think>hello world</think>x", 3),
    ("hello<think>world<tool_call>x", 3),
    (" <think>hello</think>x</think>y", 2),
    ("\n hello</tool_call>/<", 5),  # `</tool_call>`'s token uncounted, its text reasoning
    ("hello</think>world</think>tool<think>x", 1),
])
def test_usage_counts_no_token_of_a_dropped_tag(text, count):
    qwen = qwen_tokenizer()
    ids = qwen.encode(text, add_special_tokens=False)
    assert ThinkTokens.of(qwen, "qwen3").count(ids) == count
