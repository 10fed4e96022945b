"""vLLM 0.32's `deepseek_r1` reasoning parser (vllm/reasoning/basic_parsers.py's
BaseThinkingReasoningParser): usage's reasoning tokens by its depth counter
(count_reasoning_tokens: a `<think>` one deeper, a `</think>` one shallower, never below 0,
the tokens counted at a depth above 0), over the output's ids alone whatever the prompt or
the split (0 for an output without `<think>`, one whose prompt opened the block); and its
split, which specserve follows where the output's first `<think>` opens it (after
whitespace) or it holds none. Its whole answer (extract_reasoning) partitions the output at
its first `<think>` anywhere, what comes before it dropped, a reasoning already streamed
included (`a</think>b<think>c`: reasoning `c`, content null): no stream can send that
before the output ends, its own neither (one token a delta it sends `a` and `b<think>c`),
and its grammar after the reasoning starts after the first `</think>` all the same; here
the split stays at the first `</think>`, the stream adding up to the whole answer. The
rows are vLLM 0.32's own, read off its parser on test_qwen3_tool_end's tokenizer (the tags
whole, each one id, as vLLM requires)."""

import pytest

from deployments.reasoning import ReasoningSplit, ThinkTokens
from tests.unit.test_qwen3_tool_end import qwen_tokenizer
from tests.unit.test_reasoning import usages

COUNTS = [  # an output's text: vLLM 0.32's deepseek_r1 count_reasoning_tokens of its ids
    ("hello world</think>x", 0),  # the prompt opened the block: none counted
    ("hello world", 0),
    ("<think>hello world</think>x", 2),
    ("<think>hello world", 2),  # max_tokens inside the reasoning
    ("<think>hello</think>", 1),
    ("x<think>hello</think>world", 1),  # not what comes before the `<think>`
    ("<think><think>hello</think>world</think>x", 3),  # nested: counted to the outer end
    ("</think>hello<think>world", 2),  # a stray `</think>` ends nothing
    ("<think>hello</think>world<think>x</think>y", 2),  # every block counted
]
SPLITS = [  # an output's text: its (reasoning, content), vLLM 0.32's whole answer
    ("hello world</think>x", ("hello world", "x")),
    ("\n<think>hello</think>world", ("hello", "world")),
    ("<think><think>hello</think>world</think>x", ("<think>hello", "world</think>x")),
    ("<think>a</think>b<think>c", ("a", "b<think>c")),  # the first `<think>` opens it
]
DEPARTURES = [  # an output's text: vLLM 0.32's whole answer, and specserve's
    ("x<think>a", ("a", None), ("x<think>a", None)),
    ("hello<think>world</think>tool", ("world", "tool"), ("hello<think>world", "tool")),
    ("a</think>b<think>c", ("c", None), ("a", "b<think>c")),
    ("</think>hello<think>world", ("world", None), ("", "hello<think>world")),
]


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.mark.parametrize("text, count", COUNTS)
def test_reasoning_tokens_are_counted_by_depth_as_vllm_does(qwen, text, count):
    ids = qwen.encode(text, add_special_tokens=False)
    assert ThinkTokens.of(qwen, "deepseek_r1").count(ids) == count


def test_usage_counts_an_unsplit_outputs_think_blocks():
    """A character a token (`<think>` ids 10 to 16, `</think>` 31 to 38): under a grammar
    from the output's first token the output is not split, but vLLM 0.32 counts its ids
    all the same (qwen3's count is 0 there: test_reasoning's)."""
    tags = ThinkTokens(start=tuple(range(10, 17)), end=tuple(range(31, 39)))
    for usage in usages("<think>Paris is nice.</think>Yes.", think_tokens=tags, split=False):
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 14}


def streamed(text: str, size: int) -> tuple[str, str | None]:
    stream, reasoning, content = ReasoningSplit("deepseek_r1").stream(), "", ""
    for start in range(0, len(text), size):
        thought, said = stream.feed(text[start:start + size])
        reasoning, content = reasoning + thought, content + said
    held, tail = stream.finish()
    return reasoning + held, (content + tail) or None


@pytest.mark.parametrize("text, split", SPLITS)
def test_the_split_is_vllms_where_the_first_think_opens_the_output(text, split):
    assert ReasoningSplit("deepseek_r1").split(text) == split
    assert all(streamed(text, size) == split for size in (1, 2, 3, 7, len(text)))


@pytest.mark.parametrize("text, vllm, split", DEPARTURES)
def test_a_think_after_text_is_text_where_vllms_whole_answer_drops_all_before(text, vllm,
                                                                              split):
    """vLLM's whole answer drops all before the first `<think>` (which may come after the
    reasoning was sent); here the split ends at the first `</think>` as the stream does."""
    assert ReasoningSplit("deepseek_r1").split(text) == split != vllm
    assert all(streamed(text, size) == split for size in (1, 2, 3, 7, len(text)))
