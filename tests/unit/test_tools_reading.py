"""Function calling without Ray, the output side: calls read out of a free output (only when
all are well formed, with tags as special tokens or kept in the decoded text); held content
sends what the whole response has as content; a streamed choice sends its calls and content
as a whole completion does (a forced call cut short too), its held end read off the event loop."""

import asyncio
import copy
import json
import threading

import pytest

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.openai_api import ChatMessage
from deployments.tools import CALL_CLOSE, CALL_OPEN, HeldContent, ToolUse
from speculative.driver import text_decoder
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Scripted, traced_peak
from tests.unit.test_tools import CALL, TOOLS, request, tokenizer  # noqa: F401 (a fixture)


def test_a_streamed_forced_call_cut_short_is_the_whole_ones():
    text = CALL[:-20]
    whole = asyncio.run(fan_out(text, {"tools": TOOLS, "tool_choice": "required"}).complete())
    message = whole["choices"][0]["message"]
    assert message["content"] is None and whole["choices"][0]["finish_reason"] == "length"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Paris", "unit": "ce'}

    async def collect():
        return [e async for e in fan_out(
            text, {"tools": TOOLS, "tool_choice": "required"}).events()]

    chunks = [json.loads(e[len("data: "):])["choices"] for e in asyncio.run(collect())[:-1]]
    deltas = [c[0] for c in chunks if c]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    assert [call["function"] for d in deltas for call in d["delta"].get("tool_calls", [])] \
        == [message["tool_calls"][0]["function"]]
    assert deltas[-1]["finish_reason"] == "length"


def test_calls_are_read_out_of_a_free_output_only_when_all_are_well_formed():
    use = request(tools=TOOLS).tool_use()
    now = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    content, calls = use.read_calls("Let me look.\n" + CALL + now)
    assert content == "Let me look.\n" and [c["function"]["name"] for c in calls] == \
        ["get_weather", "now"]
    assert len({c["id"] for c in calls}) == 2
    single = request(tools=TOOLS, parallel_tool_calls=False).tool_use()
    assert len(single.read_calls(CALL + now)[1]) == 1
    for text in ["def f():\n    pass\n", CALL.replace("}}<", "}<"),
                 CALL.replace("get_weather", "unknown"), CALL + "<tool_call>{}</tool_call>",
                 CALL.replace('{"city": "Paris", "unit": "celsius"}', '"Paris"'),
                 "<tool_call>never closed", '<tool_call>{"name": "now", "arguments": '
                 '{"x": Infinity}}</tool_call>', "<tool_call>" + "[" * 5000]:
        assert use.read_calls(text) == (text, []), text


def test_the_last_call_may_end_without_its_closing_tag():
    """A stop string `</tool_call>`, or the model's end token right after the object, leaves
    the last call unclosed: it is still a call (vLLM's Hermes parser reads it too), but a call
    cut inside its object, or followed by other text, is not."""
    use = request(tools=TOOLS).tool_use()
    now = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    for text in ["Checking. " + CALL[:-len("</tool_call>")], "Checking. " + CALL[:-12] + "\n",
                 "Checking. " + now + CALL[:-len("</tool_call>")]]:
        content, calls = use.read_calls(text)
        assert content == "Checking. " and calls[-1]["function"]["name"] == "get_weather", text
        assert use.read(text, "stop")[2] == "tool_calls"
    for text in [CALL[:-len("}</tool_call>")], CALL[:-len("</tool_call>")] + " more",
                 CALL[:-len("</tool_call>")] + now]:
        assert use.read_calls(text) == (text, []), text


def test_calls_are_read_when_the_tags_are_special_tokens(tokenizer):
    """Some checkpoints register <tool_call> and </tool_call> as special tokens: with tools in
    effect the output's text keeps them (other special tokens are still skipped), so the call
    is read; without, they are skipped as vLLM skips them."""
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    ids = special("Checking. " + CALL, add_special_tokens=False)["input_ids"]
    assert special.convert_tokens_to_ids("<tool_call>") in ids
    assert text_decoder(special)(ids) == "Checking. " + CALL.replace(CALL_OPEN, "").replace(
        CALL_CLOSE, "")  # without tools in effect, skipped as every special token
    decode = text_decoder(special, keep=(CALL_OPEN, CALL_CLOSE))
    assert decode(ids + [special.eos_token_id]) == "Checking. " + CALL
    content, calls = request(tools=TOOLS).tool_use().read_calls(decode(ids))
    assert content == "Checking. " and calls[0]["function"]["name"] == "get_weather"


def test_a_call_is_its_decoded_object_and_its_arguments_the_models_own_text():
    """An argument may hold `</tool_call>` (a coding agent's), and the arguments come back
    as written: 1e999 and twenty digits stay what the model wrote, and an escaped lone
    surrogate stays an escape (json.dumps would write Infinity, or a surrogate no response
    encodes)."""
    use = request(tools=TOOLS).tool_use()
    for arguments in ['{"code": "print(\'</tool_call>\')"}', '{"factor": 1e999}',
                      '{"big": 12345678901234567890.5, "s": "\\ud800 \u00e9"}', "{}"]:
        text = f'<tool_call>\n{{"name": "now", "arguments": {arguments}}}\n</tool_call>'
        content, calls = use.read_calls("Here: " + text)
        assert content == "Here: " and calls[0]["function"]["arguments"] == arguments
        json.loads(calls[0]["function"]["arguments"])
        calls[0]["function"]["arguments"].encode()
    keys_first = '<tool_call>{"arguments": {"a": [1, 2]}, "name": "now"}</tool_call>'
    assert use.read_calls(keys_first)[1][0]["function"]["arguments"] == '{"a": [1, 2]}'
    nested_first = '<tool_call>{"name": "now", "meta": {"arguments": {"a": 1}}, ' \
                   '"arguments": {"a": true}}</tool_call>'  # 1 == True to Python
    assert json.loads(use.read_calls(nested_first)[1][0]["function"]["arguments"]) == \
        {"a": True}


def test_an_assistant_call_nested_too_deeply_is_sent_to_the_template_as_text():
    deep = "[" * 100000
    message = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c1", "function": {"name": "now", "arguments": deep}}])
    assert message.for_template()["tool_calls"][0]["function"]["arguments"] == deep


@pytest.mark.parametrize("text", ["Let me look. " + CALL, "a < b <tool <tool_call> x",
                                  "plain <to", CALL + " trailing"])
def test_held_content_sends_what_the_whole_response_has_as_content(text):
    use = request(tools=TOOLS).tool_use()
    content, _ = use.read_calls(text)
    for size in (1, 2, 3, 7, len(text)):
        held, sent = HeldContent(), ""
        for start in range(0, len(text), size):
            sent += held.feed(text[start:start + size])
            assert (content or "").startswith(sent) or not sent
            assert "<tool_call>" not in sent
        assert sent + held.rest(content) == (content or ""), (text, size)


def test_held_content_costs_each_delta_its_own_length():
    """A stream under tools that never calls one (the usual answer in content) feeds every
    delta through HeldContent: one that grew and searched the whole text each time made the
    stream quadratic (14 s of the event loop over 128k tokens). Counted in bytes allocated,
    a feed after 200k characters makes no copy of them."""
    held = HeldContent()
    sent = "".join(held.feed("word ") for _ in range(40_000))
    last, peak = traced_peak(lambda: held.feed("word "))
    assert peak < 10_000 and sent + last == "word " * 40_001


def fan_out(text: str, tools: dict):
    """A request whose output is `text`, five characters a token (token 10 + j decodes to
    the text's j-th five; an empty text is token 0, a stop id)."""
    width, prompt = 5, (2, 3)
    tokens = -(-len(text) // width)
    plan = RequestFrontEnd().plan("chatcmpl-t", prompt, SamplingParams(
        temperature=0.0, max_tokens=max(tokens, 1)), n=1, stop_token_ids=(0,))
    engine = Scripted(list(range(10, 10 + tokens)), miss=tokens + 1, prompt_len=len(prompt))

    def decode(ids):
        return "".join(text[width * (i - 10):width * (i - 9)] for i in ids if i >= 10)

    return Choices(plan, (engine, engine), decode,
                   type("Metrics", (), {"record_choice": lambda self, *choice: None})(),
                   Admission(4).admit(1), model="m", chat=True, return_token_ids=False,
                   tools=request(**tools).tool_use())


@pytest.mark.parametrize("text", [
    "Checking. " + CALL, "no call <tool_call>{oops}",
    'The weather: <tool_call>{"name": "get_weather", "argu',  # cut short
    'Sure <tool_call>{"name": "nope", "arguments": {}}</tool_call>'])  # no such tool
def test_a_streamed_choice_carries_the_calls_and_content_of_the_whole_one(text):
    whole = asyncio.run(fan_out(text, {"tools": TOOLS}).complete())["choices"][0]
    # the whole output is the text: a call, or content held back in the stream and sent
    assert (whole["message"]["content"] or "") + CALL * ("tool_calls" in whole["message"]) \
        == text

    async def collect():
        return [e async for e in fan_out(text, {"tools": TOOLS}).events()]

    chunks = [json.loads(e[len("data: "):])["choices"] for e in asyncio.run(collect())[:-1]]
    deltas = [c[0] for c in chunks if c]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert content == (whole["message"]["content"] or "")
    assert [c["function"] for c in calls] == \
        [c["function"] for c in whole["message"].get("tool_calls", [])]
    assert all(c["index"] == i and c["id"].startswith("call_") for i, c in enumerate(calls))
    assert deltas[-1]["finish_reason"] == whole["finish_reason"]
    assert whole["finish_reason"] == ("tool_calls" if calls else "length")


@pytest.mark.parametrize("text", [CALL, "Checking. " + CALL, "no call <tool_call>{oops}",
                                  "plain", ""])
def test_the_openai_clients_accumulated_stream_is_the_whole_message(text):
    """The openai package rebuilds a stream's message from its deltas: a message of calls
    alone had content "" there (the role's chunk carried "") and null in the whole answer,
    as OpenAI sends it; an empty output is "" in both."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    whole = ChatCompletion.model_validate(
        asyncio.run(fan_out(text, {"tools": TOOLS}).complete())).choices[0]

    async def collect():
        return [e async for e in fan_out(text, {"tools": TOOLS}).events()]

    state = ChatCompletionStreamState()
    for event in asyncio.run(collect())[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(event[len("data: "):]))
    streamed = state.current_completion_snapshot.choices[0]
    assert streamed.message.content == whole.message.content
    assert [(c.id[:5], c.function.name, c.function.arguments)
            for c in streamed.message.tool_calls or []] == \
        [(c.id[:5], c.function.name, c.function.arguments)
         for c in whole.message.tool_calls or []]
    assert streamed.finish_reason == whole.finish_reason


def test_a_streamed_choices_held_end_is_read_off_the_event_loop(monkeypatch):
    """From a `<tool_call>` on, a stream holds its text (and its tokens' logprobs) to the
    end, then reads it as calls or content: that reading and its chunks' encoding ran on the
    event loop, every other stream held meanwhile (a chat's 2,048 tokens with their top 20
    logprobs: 0.35 s to read them, then 0.05 s to encode in one call)."""
    threads, read = [], ToolUse.read_calls

    def reading(self, text):
        threads.append(threading.current_thread())
        return read(self, text)

    monkeypatch.setattr(ToolUse, "read_calls", reading)

    async def collect():
        return [e async for e in fan_out(CALL, {"tools": TOOLS}).events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    assert [c["function"]["name"] for chunk in chunks for c in
            chunk["choices"][0]["delta"].get("tool_calls", [])] == ["get_weather"]
    assert threads and all(thread is not threading.main_thread() for thread in threads)


def test_kept_tags_leave_a_sentencepiece_texts_spaces_as_they_are():
    """Decoded in pieces split at each kept tag, a SentencePiece tokenizer dropped the
    leading space of the text after it (" again" after </tool_call> came back "again")."""
    from tests.tiny import metaspace_tokenizer

    special = metaspace_tokenizer()
    special.add_special_tokens({"additional_special_tokens": [CALL_OPEN, CALL_CLOSE]})
    opening, closing, hello, world, again = special.convert_tokens_to_ids(
        [CALL_OPEN, CALL_CLOSE, "▁hello", "▁world", "▁again"])
    ids = [hello, opening, world, closing, again, special.eos_token_id]
    decode = text_decoder(special, keep=(CALL_OPEN, CALL_CLOSE))
    assert decode(ids) == "hello<tool_call> world</tool_call> again"
