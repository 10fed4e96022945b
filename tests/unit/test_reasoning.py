"""Reasoning outputs without Ray (vLLM's --reasoning-parser): a thinking model's output split
into its reasoning and its content, whole and streamed (a `</think>` split across deltas), an
output without its `<think>` or its `</think>`, calls read out of the content alone, and the
parser off or out of the request's way (the output unchanged)."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.held_text import StreamedText
from deployments.openai_api import ChatCompletionRequest
from deployments.reasoning import ReasoningSplit, ReasoningStream, ThinkTokens, reasoning_split
from deployments.router import Router
from deployments.router_args import RouterArgs
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Scripted, char_tokenizer, traced_peak

CALL = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "now"}}]
SPLITS = [  # an output's text: its (reasoning, content), as vLLM's deepseek_r1 reads it (and
    # qwen3, but where QWEN3_SPLITS says otherwise)
    ("<think>Paris is the capital.</think>Paris.", ("Paris is the capital.", "Paris.")),
    # DeepSeek-R1's template ends the prompt with `<think>`: the output starts inside it
    ("Paris is the capital.</think>\n\nParis.", ("Paris is the capital.", "\n\nParis.")),
    ("\n<think>\nhm\n</think>\n\nyes", ("\nhm\n", "\n\nyes")),
    ("still thinking when max_tokens came", ("still thinking when max_tokens came", None)),
    ("<think>cut short", ("cut short", None)),
    ("done thinking</think>", ("done thinking", None)),  # content null when empty
    ("<think></think>answer", ("", "answer")),
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first `</think>` ends it, the rest kept
    ("<thinking is text</think>x", ("<thinking is text", "x")),
    ("cut inside the tag </thi", ("cut inside the tag </thi", None)),
    ("<thi", ("<thi", None)),
    ("", ("", None)),
]
# vLLM 0.32's qwen3 (its parser engine's grammar, read off it on a tokenizer holding the tags
# whole): every `<think>` in the reasoning dropped, the whitespace before it kept; every
# `</think>` in the content dropped
QWEN3_SPLITS = {"\n<think>\nhm\n</think>\n\nyes": ("\n\nhm\n", "\n\nyes"),
                "a</think>b</think>c": ("a", "bc")}


@pytest.mark.parametrize("text, split", SPLITS)
def test_a_whole_output_is_split_at_its_first_end_of_thinking(text, split):
    assert ReasoningSplit("deepseek_r1").split(text) == split
    assert ReasoningSplit("qwen3").split(text) == QWEN3_SPLITS.get(text, split)


@pytest.mark.parametrize("text, split", SPLITS)
def test_a_streamed_output_adds_up_to_the_whole_ones_split(text, split):
    """Whatever the deltas, a tag split across them included: no tag's text goes out, and
    what does adds up to the whole output's reasoning and content."""
    for size in (1, 2, 3, 7, max(len(text), 1)):
        stream, reasoning, content = ReasoningStream(), "", ""
        for start in range(0, len(text), size):
            thought, said = stream.feed(text[start:start + size])
            reasoning, content = reasoning + thought, content + said
            assert "</think>" not in reasoning and not reasoning.startswith("<think>")
        assert (reasoning + stream.finish()[0], content or None) == split, (text, size)


def test_an_end_of_thinking_split_across_deltas_is_held_to_the_next():
    stream = ReasoningStream()
    assert stream.feed("<th") == ("", "")  # may open the output's reasoning
    assert stream.feed("ink>Paris is the capital</th") == ("Paris is the capital", "")
    assert stream.feed("i") == ("", "")
    assert stream.feed("nk>Par") == ("", "Par")
    assert stream.feed("is.") == ("", "is.")
    assert stream.finish() == ("", "")


def test_the_split_is_asked_for_by_the_router_and_stays_out_of_a_grammars_way():
    assert reasoning_split(None, None, False) is None  # off by default, as vLLM
    assert reasoning_split("deepseek_r1", None, False) == ReasoningSplit("deepseek_r1")
    # a grammar constrains the output from its first token: it holds no reasoning
    assert reasoning_split("qwen3", None, True) is None
    # Qwen3 asked not to think: its template closes an empty block in the prompt
    assert reasoning_split("qwen3", {"enable_thinking": False}, False) is None
    assert reasoning_split("qwen3", {"enable_thinking": True}, False) is not None
    assert reasoning_split("deepseek_r1", {"enable_thinking": False}, False) is not None
    assert RouterArgs().reasoning_parser is None
    assert RouterArgs(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValidationError):
        RouterArgs(reasoning_parser="hermes")


def test_an_opening_of_whitespace_costs_each_delta_its_own_length():
    """Whitespace that may still come before a `<think>` waits (dropped before one, as
    vLLM's parsers drop it): grown and stripped whole at each delta, an output of newlines
    (a small model's degenerate answer) cost its square, 1.6 s of the event loop over 80k.
    Counted in bytes allocated, a feed after 40k of them makes no copy of them (a list of
    the pieces grows now and then: one of two feeds in a row is without)."""
    stream = ReasoningStream()
    assert all(stream.feed("\n") == ("", "") for _ in range(40_000))
    peaks = [traced_peak(lambda: stream.feed(" "))[1] for _ in range(2)]
    assert min(peaks) < 10_000
    assert stream.feed("<think>hm</th") == ("hm", "")
    assert stream.feed("ink> yes") == ("", " yes")
    spaced = ReasoningStream()
    assert all(spaced.feed(" ") == ("", "") for _ in range(3))
    assert spaced.feed("\nhm") == ("   \nhm", "") and spaced.finish() == ("", "")


# an output's pieces: the tags and their beginnings, a call's, whitespace, and text
PIECES = st.sampled_from(["<think>", "</think>", "<th", "</th", "ink>", "<", ">", "\n", " ",
                          "a", "b c", CALL, "<tool_call>", "<tool"])


@settings(max_examples=300, deadline=None)
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@given(st.lists(PIECES, max_size=10), st.lists(st.integers(1, 9), min_size=1, max_size=20),
       st.booleans(), st.booleans())
def test_every_split_of_an_output_streams_as_its_whole_answer(parser, pieces, cuts, tools,
                                                              shown):
    """Whatever the deltas (a tag or a call cut anywhere, whitespace alone, none at all),
    with tools or without, the reasoning shown or not, under either parser (qwen3's implicit
    end at a `<tool_call>` and its dropped tags): what a stream sends (StreamedText, then its
    rest at the end) adds up to the whole answer's reasoning and content."""
    text = "".join(pieces)
    split = ReasoningSplit(parser, shown)
    use = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "?"}], "tools": TOOLS}).tool_use()
    reasoning, content = split.split(text)
    if tools and content is not None:
        content, _, _ = use.read(content, "stop")
    streamed, sent, at = StreamedText(split, use if tools else None), [], 0
    for cut in cuts * len(text):
        if at >= len(text):
            break
        if (parts := streamed.feed(text[at:at + cut])) is not None:
            sent.append(parts)
        at += cut
    if (rest := streamed.rest(content)) is not None:
        sent.append(rest)
    assert "".join(r for r, _ in sent) == (reasoning if shown else "")
    assert "".join(c for _, c in sent) == (content or "")


def fan_out(text: str, parser: str | None = "deepseek_r1", tools=None,
            continuous_usage: bool = False, shown: bool = True, width: int = 3,
            miss: int = 3, think_tokens: ThinkTokens | None = None,
            split: bool = True) -> Choices:
    """A chat request whose output is `text`, three characters a token (token 10 + j decodes
    to the text's j-th three; or `width`), committed 1 to 3 tokens a round (1 to `miss`)."""
    prompt = (2, 3)
    tokens = -(-len(text) // width)
    plan = RequestFrontEnd().plan("chatcmpl-r", prompt, SamplingParams(
        temperature=0.0, max_tokens=max(tokens, 1)), n=1, stop_token_ids=(0,))
    engine = Scripted(list(range(10, 10 + tokens)), miss=miss, prompt_len=len(prompt))

    def decode(ids):
        return "".join(text[width * (i - 10):width * (i - 9)] for i in ids if i >= 10)

    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "?"}], **({"tools": tools} if tools else {})})
    return Choices(plan, (engine, engine), decode,
                   type("Metrics", (), {"record_choice": lambda self, *choice: None})(),
                   Admission(4).admit(1), model="m", chat=True, return_token_ids=False,
                   tools=body.tool_use(), continuous_usage=continuous_usage,
                   include_usage=True, think_tokens=think_tokens,
                   reasoning=reasoning_split(parser, None, not split, shown))


def whole_and_streamed(text: str, **options) -> tuple[dict, list[dict]]:
    """The whole answer's choice, and the streamed one's deltas (with its finish_reason)."""
    whole = asyncio.run(fan_out(text, **options).complete())["choices"][0]

    async def collect():
        return [e async for e in fan_out(text, **options).events()]

    chunks = [json.loads(e[len("data: "):])["choices"] for e in asyncio.run(collect())[:-1]]
    return whole, [c[0] for c in chunks if c]


def accumulated(deltas: list[dict], field: str) -> str | None:
    parts = [d["delta"][field] for d in deltas if d["delta"].get(field) is not None]
    return "".join(parts) if any(parts) else None


@settings(max_examples=60, deadline=None)
@given(st.lists(PIECES, max_size=8), st.integers(1, 4), st.integers(2, 4), st.booleans(),
       st.booleans())
def test_a_streamed_chat_answer_adds_up_to_the_whole_one(pieces, width, miss, tools,
                                                         continuous_usage):
    """The same through a choice's stream (its role's chunk, the rounds' deltas, the held
    rest and the end): its deltas accumulated are the whole answer's reasoning, content and
    calls, and no delta between the role's and the end is empty."""
    text, options = "".join(pieces), {"tools": TOOLS if tools else None, "width": width,
                                      "miss": miss, "continuous_usage": continuous_usage}
    whole, deltas = whole_and_streamed(text, **options)
    message = whole["message"]
    assert accumulated(deltas, "reasoning") == (message["reasoning"] or None)
    assert accumulated(deltas, "content") == message["content"]
    assert [c["function"] for d in deltas for c in d["delta"].get("tool_calls", [])] == \
        [c["function"] for c in message.get("tool_calls", [])]
    assert all(d["delta"] != {} and d["delta"] != {"content": None} for d in deltas[1:-1])
    assert deltas[-1]["finish_reason"] == whole["finish_reason"]


@pytest.mark.parametrize("continuous_usage", [False, True])
@pytest.mark.parametrize("text, split", SPLITS)
def test_a_chat_answer_carries_its_reasoning_whole_and_streamed(text, split, continuous_usage):
    whole, deltas = whole_and_streamed(text, continuous_usage=continuous_usage)
    reasoning, content = split
    assert (whole["message"]["reasoning"], whole["message"]["content"]) == (reasoning,
                                                                            content)
    assert accumulated(deltas, "reasoning") == (reasoning or None)
    assert accumulated(deltas, "content") == content
    assert all("<think>" not in (d["delta"].get("reasoning") or "") for d in deltas)
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == \
        ("length" if text else "stop")  # max_tokens, or the empty output's end token


def test_a_split_end_of_thinking_streams_as_separate_deltas():
    """Three characters a token: `</think>` spans three tokens, and the rounds' deltas cut
    it; none of its text reaches a delta."""
    text = "I think so.</think>Yes."
    _, deltas = whole_and_streamed(text)
    assert len(deltas) > 3
    sent = [(d["delta"].get("reasoning"), d["delta"].get("content")) for d in deltas]
    assert all("</" not in (part or "") for pair in sent for part in pair)
    assert accumulated(deltas, "reasoning") == "I think so."
    assert accumulated(deltas, "content") == "Yes."


def test_calls_are_read_out_of_the_content_after_the_reasoning():
    whole, deltas = whole_and_streamed("I should ask the time.</think>" + CALL, tools=TOOLS)
    message = whole["message"]
    assert message["reasoning"] == "I should ask the time."
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    assert whole["finish_reason"] == "tool_calls" == deltas[-1]["finish_reason"]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["now"]
    assert accumulated(deltas, "reasoning") == "I should ask the time."
    assert accumulated(deltas, "content") is None


def test_a_call_inside_the_reasoning_is_reasoning():
    text = "maybe " + CALL + " then answer"  # cut at max_tokens inside the reasoning
    whole, deltas = whole_and_streamed(text, tools=TOOLS)
    assert whole["message"]["reasoning"] == text
    assert whole["message"]["content"] is None and "tool_calls" not in whole["message"]
    assert whole["finish_reason"] == "length" == deltas[-1]["finish_reason"]
    assert accumulated(deltas, "reasoning") == text
    assert not any(d["delta"].get("tool_calls") for d in deltas)


@pytest.mark.parametrize("text", ["<think>Paris.</think>Paris.", "plain", ""])
def test_without_a_parser_the_answer_is_the_whole_text_as_before(text):
    whole, deltas = whole_and_streamed(text, parser=None)
    assert whole["message"] == {"role": "assistant", "content": text}
    assert all("reasoning" not in d["delta"] for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == text


@pytest.mark.parametrize("text", ["I should ask.</think>" + CALL, "Paris?</think>Paris.",
                                  "cut short"])
def test_include_reasoning_false_splits_the_reasoning_off_and_sends_none(text):
    """vLLM's include_reasoning: false: the content as ever, the reasoning null and in no
    delta (it was taken and ignored: every answer carried it)."""
    shown, _ = whole_and_streamed(text, tools=TOOLS)
    whole, deltas = whole_and_streamed(text, tools=TOOLS, shown=False)
    assert whole["message"]["reasoning"] is None and shown["message"]["reasoning"]
    assert whole["message"]["content"] == shown["message"]["content"]
    assert [c["function"] for c in whole["message"].get("tool_calls", [])] == \
        [c["function"] for c in shown["message"].get("tool_calls", [])]
    assert not any(d["delta"].get("reasoning") for d in deltas)
    assert accumulated(deltas, "content") == whole["message"]["content"]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"]


def test_a_continued_reply_that_closed_its_reasoning_is_continued_as_content():
    """continue_final_message: a begun reply that holds its `</think>` (after its last
    `<think>`) is carried on in the content, as vLLM reads a prompt that ended the
    reasoning; one still inside its reasoning (or with no tags) is split as ever. Before,
    the output was all reasoning, its content null."""
    router = SimpleNamespace(args=RouterArgs(reasoning_parser="deepseek_r1"))
    plan = SimpleNamespace(choices=[])
    for reply, split in [("<think>a</think>The answer is", None),
                         ("<think>a</think>b<think>c", ReasoningSplit("deepseek_r1")),
                         ("The answer is", ReasoningSplit("deepseek_r1"))]:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "?"},
                          {"role": "assistant", "content": reply}],
             "add_generation_prompt": False, "continue_final_message": True})
        assert Router.reasoning(router, body, plan) == split
    body = ChatCompletionRequest.model_validate(  # a whole earlier reply: not continued
        {"messages": [{"role": "assistant", "content": "<think>a</think>b"},
                      {"role": "user", "content": "?"}]})
    assert Router.reasoning(router, body, plan) == ReasoningSplit("deepseek_r1")


def test_the_router_reads_include_reasoning():
    router = SimpleNamespace(args=RouterArgs(reasoning_parser="qwen3"))
    plan = SimpleNamespace(choices=[])
    for include in (True, False):
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "?"}], "include_reasoning": include})
        assert Router.reasoning(router, body, plan) == ReasoningSplit("qwen3", include)


@pytest.mark.parametrize("ids, count", [  # vLLM 0.32's deepseek_r1 count_reasoning_tokens
    ([5, 1, 2, 6, 3], 2),  # `<think>` a b `</think>` c: the tags are not reasoning
    ([1, 2, 6, 3], 0),  # the prompt opened the block: no `<think>` in the output, none counted
    ([5, 1, 2], 2),  # max_tokens inside the reasoning: all of it
    ([6, 3], 0),
    ([], 0),
    ([5], 0),
    ([1, 5, 2, 6], 1),  # what comes before the `<think>` is not counted
    ([7, 9, 1, 7, 1, 7, 8, 2, 7, 8], 3),  # tags of two tokens: read where they stand whole
])
def test_reasoning_tokens_are_counted_inside_the_think_blocks(ids, count):
    tags = ThinkTokens(start=(5,), end=(6,)) if 7 not in ids else ThinkTokens((7, 9), (7, 8))
    assert tags.count(ids) == count


def usages(text: str, **options) -> tuple[dict, dict]:
    """The usage of the whole answer and of the stream's last chunk."""
    whole = asyncio.run(fan_out(text, width=1, **options).complete())

    async def collect():
        return [e async for e in fan_out(text, width=1, **options).events()]

    last = json.loads(asyncio.run(collect())[-2][len("data: "):])
    return whole["usage"], last["usage"]


def test_usage_counts_a_chats_reasoning_tokens_whole_and_streamed():
    """A character a token: the reasoning's 14 tokens between `<think>`'s 7 (ids 10 to 16)
    and `</think>`'s 8 (ids 31 to 38), reported as vLLM's usage does under a reasoning
    parser; 0 where the output holds no `<think>` (deepseek_r1's count: the prompt opened
    the block) or, for qwen3, where the request's output is all content (a grammar's);
    absent without a parser."""
    text = "<think>Paris is nice.</think>Yes."
    tags = ThinkTokens(start=tuple(range(10, 17)), end=tuple(range(31, 39)))
    for usage in usages(text, think_tokens=tags):
        assert usage["completion_tokens"] == len(text)
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 14}
    for usage in usages("Paris is nice.</think>Yes.",
                        think_tokens=ThinkTokens((99,), tuple(range(24, 32)))):
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    qwen3 = ThinkTokens(tags.start, tags.end, inner_starts=True)
    for usage in usages(text, parser="qwen3", think_tokens=qwen3, split=False):
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    for usage in usages(text, parser=None):
        assert "completion_tokens_details" not in usage


def test_the_router_reads_the_tags_with_its_tokenizer():
    tokenizer = char_tokenizer("<>/thinkab")
    tags = ThinkTokens.of(tokenizer)
    assert tokenizer.decode(list(tags.start)) == "<think>"
    assert tokenizer.decode(list(tags.end)) == "</think>"
    assert tags.count(tokenizer.encode("<think>ab</think>a")) == 2
