"""The router's tool_call_parser without Ray: an "auto" output's calls read in Llama's JSON
format, in Mistral's `[TOOL_CALLS]` one and in the pythonic one (its own reading:
test_pythonic_calls), whole and streamed over any split of the output,
each refused (all content) where a call is malformed or names no offered function; Hermes'
reading stays the default, and a forced call's reading whatever the parser."""

import asyncio
import copy
import dataclasses
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
from deployments.router import Router
from deployments.router_args import RouterArgs
from deployments.tool_parsers import KEPT_TEXTS, HeldContent, HeldOpening
from engine.models import DEMO_TARGET, load_tokenizer
from speculative.driver import text_decoder
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Scripted, traced_peak
from tests.unit.test_tools import CALL, TOOLS

PARIS = '{"city": "Paris", "unit": "celsius"}'
LLAMA = '{"name": "get_weather", "parameters": ' + PARIS + '}'
LLAMA_NOW = '{"name": "now", "parameters": {}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + PARIS + '}]'
MISTRAL_BOTH = '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + PARIS + \
    '}, {"name": "now", "arguments": {}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]' + PARIS
PYTHONIC = '[get_weather(city="Paris", unit="celsius")]'


def use_of(parser: str, **fields):
    """The tools in effect of a chat request, read under the parser (as the router sets)."""
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "?"}], "tools": TOOLS, **fields})
    return dataclasses.replace(body.tool_use(), parser=parser)


def named(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text, calls", [
    (LLAMA, [("get_weather", PARIS)]),
    ("\n " + LLAMA + "\n", [("get_weather", PARIS)]),
    ("<|python_tag|>" + LLAMA, [("get_weather", PARIS)]),
    (" <|python_tag|> " + LLAMA + "; " + LLAMA_NOW, [("get_weather", PARIS), ("now", "{}")]),
    (LLAMA + "\n" + LLAMA_NOW, [("get_weather", PARIS), ("now", "{}")]),
    (LLAMA + ";", [("get_weather", PARIS)]),
    (LLAMA + " I called the forecast.", [("get_weather", PARIS)]),  # dropped, as vLLM's
    ('{"name": "now", "arguments": {"n": 1e999}}', [("now", '{"n": 1e999}')]),  # as written
    ('{"name": "now", "arguments": {"a": 1}, "parameters": {"b": 2}}', [("now", '{"a": 1}')]),
])
def test_llama3_json_reads_an_output_of_json_calls(text, calls):
    content, read, finish_reason = use_of("llama3_json").read(text, "stop")
    assert content is None and named(read) == calls and finish_reason == "tool_calls"


@pytest.mark.parametrize("text", [
    "Sure: " + LLAMA,  # calls open the output, or it is content (as vLLM streams it)
    LLAMA.replace("get_weather", "unknown"), LLAMA + "; " + LLAMA_NOW.replace("now", "later"),
    LLAMA + "\n{not json", LLAMA[:-1], '{"name": "now"}', '{"name": "now", "parameters": 3}',
    '{"name": 7, "parameters": {}}', '{"name": "now", "parameters": {"x": NaN}}',
    "<|python_tag|>brave_search.call(query='Paris')", "<|python_tag|>", "{", "", "plain",
    '["now"]', "{" * 5000])
def test_llama3_json_leaves_what_is_not_calls_as_content(text):
    assert use_of("llama3_json").read(text, "stop") == (text, [], "stop")


@pytest.mark.parametrize("text, content, calls", [
    (MISTRAL, None, [("get_weather", PARIS)]),
    ("Checking. " + MISTRAL_BOTH, "Checking. ", [("get_weather", PARIS), ("now", "{}")]),
    (MISTRAL + "</s> trailing", None, [("get_weather", PARIS)]),  # raw_decode's, as vLLM's
    (MISTRAL_V11, None, [("get_weather", PARIS)]),
    ("Let me see." + MISTRAL_V11 + "[TOOL_CALLS]now{}", "Let me see.",
     [("get_weather", PARIS), ("now", "{}")]),
    ("[TOOL_CALLS]now {}", None, [("now", "{}")]),  # `[ARGS]` skipped as a special token
    ("[TOOL_CALLS]" + MISTRAL[len("[TOOL_CALLS]"):].replace(PARIS, '{"s": "[TOOL_CALLS]"}')
     + "[TOOL_CALLS]now{}", None, [("get_weather", '{"s": "[TOOL_CALLS]"}'), ("now", "{}")]),
])
def test_mistral_reads_tool_calls_after_the_content(text, content, calls):
    read_content, read, finish_reason = use_of("mistral").read(text, "stop")
    assert (read_content, named(read), finish_reason) == (content, calls, "tool_calls")


@pytest.mark.parametrize("text", [
    MISTRAL.replace("get_weather", "unknown"), MISTRAL_V11.replace("get_weather", "nope"),
    MISTRAL + "[TOOL_CALLS]later{}", "[TOOL_CALLS][]", "[TOOL_CALLS]", "[TOOL_CALLS] hi",
    MISTRAL[:-1], MISTRAL.replace(PARIS, '"Paris"'), '[TOOL_CALLS][{"name": "now"}]',
    "[TOOL_CALLS]now[ARGS]", "[TOOL_CALLS]now[ARGS][1]", "[TOOL_CALLS]" + "[" * 5000,
    "plain [TOOL", "", LLAMA, CALL])
def test_mistral_leaves_what_is_not_calls_as_content(text):
    assert use_of("mistral").read(text, "length") == (text, [], "length")


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", LLAMA + "; " + LLAMA_NOW), ("mistral", MISTRAL_BOTH),
    ("mistral", MISTRAL_V11 + "[TOOL_CALLS]now[ARGS]{}"),
    ("hermes", CALL + '<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
    ("pythonic", PYTHONIC[:-1] + ", now()]")])
def test_parallel_calls_and_parallel_tool_calls_false(parser, text):
    assert [c["function"]["name"] for c in use_of(parser).read_calls(text)[1]] == \
        ["get_weather", "now"]
    first = use_of(parser, parallel_tool_calls=False).read_calls(text)[1]
    assert [c["function"]["name"] for c in first] == ["get_weather"]
    assert first[0]["id"].startswith("call_")


def test_hermes_stays_the_default_and_a_forced_call_is_read_as_hermes_whatever_the_parser():
    assert RouterArgs().tool_call_parser == "hermes"
    assert RouterArgs(tool_call_parser="llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(ValidationError):
        RouterArgs(tool_call_parser="granite")
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "?"}], "tools": TOOLS})
    default = body.tool_use()
    assert default.parser == "hermes" and isinstance(default.held_content(), HeldContent)
    assert named(default.read_calls(CALL)[1]) == [("get_weather", PARIS)]
    for text in [LLAMA, MISTRAL, MISTRAL_V11, PYTHONIC]:  # another format is content
        assert default.read(text, "stop") == (text, [], "stop")
    for parser in ["llama3_json", "mistral", "pythonic"]:
        for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
            forced = use_of(parser, tool_choice=choice)
            assert named(forced.read(CALL, "stop")[1]) == [("get_weather", PARIS)]
            assert all(forced.read(text, "stop")[1] == [] for text in [LLAMA, MISTRAL, PYTHONIC])
            held = forced.held_content()
            assert isinstance(held, HeldContent) and held.feed(CALL[:12]) == ""


def streamed(use, text: str, cuts: list[int]) -> list[str]:
    """What a stream of the text sends as content, cut into deltas of the cuts' lengths (in
    turn): each delta's, then the rest held to the end."""
    stream, sent, at = StreamedText(None, use), [], 0
    content, _ = use.read_calls(text)
    for cut in cuts * len(text):
        if at >= len(text):
            break
        if (parts := stream.feed(text[at:at + cut])) is not None:
            sent.append(parts[1])
        at += cut
    if (rest := stream.rest(content)) is not None:
        sent.append(rest[1])
    return sent


PIECES = {"llama3_json": [LLAMA, LLAMA_NOW, "<|python_tag|>" + LLAMA, "; " + LLAMA_NOW,
                          "<|python_tag|>", "<|py", "thon_tag|>", ";", "{", "}", " ", "\n",
                          "a", '"'],
          "mistral": [MISTRAL, MISTRAL_V11, "[TOOL_CALLS]", "[TOOL", "_CALLS]", "now", "{}",
                      "[", "]", " ", "\n", "a", "b c"],
          "hermes": [CALL, "<tool_call>", "<tool", " ", "a", LLAMA, MISTRAL],
          "pythonic": [PYTHONIC, "[", "now(", "now", "(", ")", "]", ", ", "city='Paris'", " ",
                       "\n", "a", "[now()]", "x=-1", "=", '"']}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(PIECES)).flatmap(lambda parser: st.tuples(
    st.just(parser), st.lists(st.sampled_from(PIECES[parser]), max_size=8))),
       st.lists(st.integers(1, 9), min_size=1, max_size=20))
def test_every_split_of_an_output_streams_its_whole_content(drawn, cuts):
    """Whatever the parser and the deltas (a tag or a call cut anywhere, whitespace alone,
    none at all): what a stream sends adds up to the whole answer's content, and no delta
    sends what the whole answer reads as a call."""
    parser, pieces = drawn
    text, use = "".join(pieces), use_of(parser)
    content, _ = use.read_calls(text)
    sent = streamed(use, text, cuts)
    assert "".join(sent) == (content or "")
    assert all((content or "").startswith("".join(sent[:i])) for i in range(len(sent)))


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", LLAMA), ("llama3_json", "\n\n<|python_tag|>" + LLAMA + ";" + LLAMA_NOW),
    ("llama3_json", "The forecast: " + LLAMA), ("llama3_json", "  {oops} "),
    ("llama3_json", " <|python"), ("mistral", "Checking. " + MISTRAL_BOTH),
    ("mistral", MISTRAL_V11 + "[TOOL_CALLS]now{}"), ("mistral", "plain [TOOL_CALLS] oops"),
    ("mistral", "no call [TOOL_"), ("pythonic", PYTHONIC),
    ("pythonic", "\n [now(), get_weather(city='Paris')] "), ("pythonic", "[now()] and then"),
    ("pythonic", "[Note] plain"), ("pythonic", " [now"), ("pythonic", "[later()]")])
@pytest.mark.parametrize("width", [1, 3, 5])
def test_a_streamed_choice_carries_the_calls_and_content_of_the_whole_one(parser, text,
                                                                          width):
    whole = asyncio.run(fan_out(text, parser, width).complete())["choices"][0]

    async def collect():
        return [e async for e in fan_out(text, parser, width).events()]

    chunks = [json.loads(e[len("data: "):])["choices"] for e in asyncio.run(collect())[:-1]]
    deltas = [c[0] for c in chunks if c]
    parts = [d["delta"]["content"] for d in deltas if d["delta"].get("content") is not None]
    assert ("".join(parts) if any(parts) else None) == whole["message"]["content"]
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert [c["function"] for c in calls] == \
        [c["function"] for c in whole["message"].get("tool_calls", [])]
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == \
        ("tool_calls" if calls else "length")


def fan_out(text: str, parser: str, width: int) -> Choices:
    """A chat request with tools whose output is `text`, `width` characters a token."""
    prompt, tokens = (2, 3), -(-len(text) // width)
    plan = RequestFrontEnd().plan("chatcmpl-p", prompt, SamplingParams(
        temperature=0.0, max_tokens=max(tokens, 1)), n=1, stop_token_ids=(0,))
    engine = Scripted(list(range(10, 10 + tokens)), miss=3, prompt_len=len(prompt))

    def decode(ids):
        return "".join(text[width * (i - 10):width * (i - 9)] for i in ids if i >= 10)

    return Choices(plan, (engine, engine), decode,
                   type("Metrics", (), {"record_choice": lambda self, *choice: None})(),
                   Admission(4).admit(1), model="m", chat=True, return_token_ids=False,
                   tools=use_of(parser))


def test_an_opening_held_for_llama_costs_each_delta_its_own_length():
    """An output that opens with whitespace (then streams, or not yet known) feeds every
    delta through HeldOpening: one that grew and stripped the whole opening at each delta
    would make the stream quadratic. Counted in bytes allocated, a feed after 200k
    characters makes no copy of them."""
    for then, sent in [("", ""), ("text ", " \n" * 100_000 + "text " + "word " * 1_000)]:
        held = HeldOpening()
        streamed = "".join(held.feed(" \n") for _ in range(100_000)) + held.feed(then)
        more = "word " if then else " \n"
        streamed += "".join(held.feed(more) for _ in range(1_000))
        last, peak = traced_peak(lambda: held.feed(more))
        assert peak < 10_000 and streamed + last == sent + (more if then else "")
        whole = " \n" * 100_000 + then + more * 1_001  # its content: no call
        assert streamed + last + held.rest(whole) == whole


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", "<|python_tag|>" + LLAMA), ("mistral", "Checking. " + MISTRAL_V11),
    ("mistral", MISTRAL)])
def test_the_parsers_special_tokens_are_kept_in_the_decoded_output(parser, text):
    """`<|python_tag|>`, `[TOOL_CALLS]` and `[ARGS]` are special tokens of Llama's and
    Mistral's tokenizers: with tools in effect, the output's text keeps those its parser
    reads (the other special tokens still skipped), and its calls are read."""
    special = copy.deepcopy(load_tokenizer(DEMO_TARGET))
    special.add_special_tokens({"additional_special_tokens": [
        "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<|eom_id|>"]})
    ids = special(text + "<|eom_id|>", add_special_tokens=False)["input_ids"]
    assert special.convert_tokens_to_ids("<|eom_id|>") in ids
    decoded = text_decoder(special, keep=KEPT_TEXTS[parser])(ids)
    assert decoded == text
    assert named(use_of(parser).read_calls(decoded)[1])[0] == ("get_weather", PARIS)


def test_the_router_reads_its_tool_call_parser_into_a_chats_tools():
    for parser in ["hermes", "llama3_json", "mistral", "pythonic"]:
        router = SimpleNamespace(args=RouterArgs(tool_call_parser=parser),
                                 prompts=SimpleNamespace(chat_template=lambda body:
                                                         SimpleNamespace(call_id_length=9)))
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "?"}], "tools": TOOLS})
        use = asyncio.run(Router.tool_use(router, body))
        assert (use.parser, use.call_id_length) == (parser, 9)
        unused = body.model_copy(update={"tool_choice": "none"})
        assert asyncio.run(Router.tool_use(router, unused)) is None
