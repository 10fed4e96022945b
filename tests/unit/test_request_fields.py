"""What the request bodies accept and refuse, as OpenAI's and vLLM's servers do: null for a
nullable field is its default, stream_options only with stream, fields that would change the
answer refused rather than ignored, and a body nested too deeply a 400, not a 500."""

import asyncio
import json

import pytest
from pydantic import ValidationError
from starlette.requests import Request

from deployments import chat_messages, openai_api
from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.request_bounds import MAX_TOOL_CALLS
from deployments.prompts import PromptReader
from tests.unit.test_router_parts import JSON_TYPE

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field", ["temperature", "top_p", "n", "stream", "presence_penalty",
                                   "frequency_penalty", "seed", "stop", "max_tokens"])
def test_null_is_the_default(field):
    completion = CompletionRequest(prompt="x", **{field: None})
    assert getattr(completion, field) == CompletionRequest.model_fields[field].default
    chat = ChatCompletionRequest(messages=CHAT, logprobs=None, parallel_tool_calls=None,
                                 **{field: None})
    assert getattr(chat, field) == ChatCompletionRequest.model_fields[field].default
    assert chat.logprobs is False and chat.parallel_tool_calls is True


def test_stream_options_come_with_a_stream():
    asked = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})
    assert asked.include_usage
    assert not CompletionRequest(prompt="x", stream=True).include_usage
    with pytest.raises(ValidationError, match="only allowed when stream is true"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True})
    assert CompletionRequest(prompt="x", stream_options={}).stream_options is None  # as vLLM
    nulls = {"include_usage": None, "continuous_usage_stats": None}  # nullable, as vLLM's
    assert not CompletionRequest(prompt="x", stream=True, stream_options=nulls).include_usage
    assert CompletionRequest(prompt="x", stream_options=nulls).stream_options is None


@pytest.mark.parametrize("fields, param", [({"suffix": "}"}, "suffix"),
                                           ({"best_of": 2}, "best_of"),
                                           ({"best_of": 3, "n": 2}, "best_of")])
def test_fields_that_would_change_the_answer_are_refused(fields, param):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest(prompt="x", **fields)
    assert raised.value.errors()[0]["loc"] == (param,)


def test_what_changes_nothing_passes():
    assert CompletionRequest(prompt="x", echo=False, suffix=None, best_of=2, n=2).n == 2
    assert CompletionRequest(prompt="x", use_beam_search=False, bad_words=[],
                             allowed_token_ids=None, skip_special_tokens=True).n == 1
    assert ChatCompletionRequest(messages=CHAT, add_generation_prompt=True,
                                 chat_template_kwargs={}, continue_final_message=False).n == 1
    assert ChatCompletionRequest(messages=CHAT, return_tokens_as_token_ids=False, documents=[],
                                 functions=[], chat_template=None).n == 1


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("logits_processors", ["my.Processor"]), ("prompt_embeds", "AAAA"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"})])
def test_vllms_fields_this_server_does_not_serve_are_refused_not_ignored(field, value):
    """Each changes the answer or what it carries (OpenAI's deprecated `functions` ask for
    a function_call, which tools now give; vLLM refuses logits_processors and prompt_embeds
    unless its server enables them; OpenAI's audio output comes with the text)."""
    with pytest.raises(ValidationError, match=f"{field}: .* is not supported"):
        ChatCompletionRequest(messages=CHAT, **{field: value})
    with pytest.raises(ValidationError, match=f"{field}: .* is not supported"):
        CompletionRequest(prompt="x", **{field: value})


def test_a_chat_template_is_a_chats_field_bounded_and_a_completions_refusal():
    """A chat's own template is read (deployments.chat_templates: rendered where the router
    trusts request templates); a completion has none to render, so it asks for nothing this
    server does: refused. A template past MAX_CHAT_TEMPLATE, or not Unicode, names the field."""
    from deployments.request_bounds import MAX_CHAT_TEMPLATE

    template = "{{ messages[0].content }}"
    assert ChatCompletionRequest(messages=CHAT, chat_template=template).chat_template == template
    with pytest.raises(ValidationError, match="chat_template: .* is not supported"):
        CompletionRequest(prompt="x", chat_template=template)
    for bad in ["x" * (MAX_CHAT_TEMPLATE + 1), "{{ 'a\ud800' }}"]:
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest(messages=CHAT, chat_template=bad)
        assert refused.value.errors()[0]["loc"] == ("chat_template",)


def test_the_defaults_of_the_fields_refused_pass():
    assert ChatCompletionRequest(messages=CHAT, logits_processors=[], modalities=["text"],
                                 audio=None, structural_tag=None, echo=False).n == 1
    assert CompletionRequest(prompt="x", logits_processors=None, prompt_embeds=None).n == 1


@pytest.mark.parametrize("fields, param", [({"best_of": 2}, "best_of"),
                                           ({"best_of": 3, "n": 2}, "best_of")])
def test_a_chats_best_of_is_refused_as_a_completions_is(fields, param):
    """vLLM's chat best_of returned the likeliest n of best_of: ignored, the client would get
    another answer."""
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest(messages=CHAT, **fields)
    assert refused.value.errors()[0]["loc"] == (param,)
    assert ChatCompletionRequest(messages=CHAT, echo=False, best_of=2, n=2).n == 2


def test_min_p_reaches_the_sampling_parameters_as_vllm_takes_it():
    assert CompletionRequest(prompt="x", min_p=0.05).sampling(16).min_p == 0.05
    assert ChatCompletionRequest(messages=CHAT, min_p=None).sampling(16).min_p == 0.0
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", min_p=1.5)


@pytest.mark.parametrize("fields", [{"structured_outputs": {"json_objct": True}},
                                    {"guided_json": {"type": "object"}}, {"guided_regex": "a"},
                                    {"structural_tag": '{"structures": []}'}])
def test_a_constraint_this_server_does_not_know_is_refused_not_ignored(fields):
    body = json.dumps({"prompt": "x", **fields}).encode()
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(body), CompletionRequest, 1 << 20))
    assert refused.value.status == 400
    assert "structured_outputs" in str(refused.value) and "Value error" not in str(refused.value)
    # the field named as OpenAI's errors name it (a body-level check's too: guided_* was none)
    assert (refused.value.param or "").startswith(next(iter(fields)))


def test_vllms_earlier_fields_that_constrain_nothing_pass():
    assert CompletionRequest(prompt="x", guided_json=None, guided_decoding_backend="xgrammar")


def test_vllms_json_object_is_any_json_object():
    body = CompletionRequest(prompt="x", structured_outputs={"json_object": True})
    assert body.constraint() == ("structured_outputs.json_object", "json", {"type": "object"})
    assert CompletionRequest(prompt="x", structured_outputs={"json_object": False}) \
        .constraint() is None


@pytest.mark.parametrize("options", [{"structural_tag": None, "whitespace_pattern": None},
                                     {"disable_any_whitespace": False, "disable_fallback": False,
                                      "disable_additional_properties": False}])
def test_vllms_structured_options_at_their_defaults_pass(options):
    """As a client serialising vLLM's StructuredOutputsParams whole sends them; set, refused."""
    body = CompletionRequest(prompt="x", structured_outputs={"choice": ["a"], **options})
    assert body.constraint() == ("structured_outputs.choice", "choice", ["a"])
    with pytest.raises(ValidationError, match="disable_any_whitespace"):
        CompletionRequest(prompt="x",
                          structured_outputs={"regex": "a", "disable_any_whitespace": 1})


def test_k_is_bounded_as_the_pools_bound_it():
    """Up to the pools' MAX_SPECULATIVE_TOKENS, as the CLI's -k (HTTP stopped at 32)."""
    from deployments.router_args import RouterArgs
    from speculative.options import MAX_SPECULATIVE_TOKENS as most

    assert CompletionRequest(prompt="x", num_speculative_tokens=most).num_speculative_tokens \
        == most
    assert RouterArgs(num_speculative_tokens=most, adaptive_k={"max": most})
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", num_speculative_tokens=most + 1)


def test_vllms_top_k_of_minus_one_and_an_int64_seed_are_taken():
    assert CompletionRequest(prompt="x", top_k=-1).sampling(16).top_k == 0
    seeds = {CompletionRequest(prompt="x", seed=seed).sampling(16).seed
             for seed in (-2**63, -2, 0, 2**63 - 1)}
    assert len(seeds) == 4 and all(0 <= seed < 2**64 for seed in seeds)
    for bad in ({"top_k": -2}, {"seed": 2**63}, {"seed": -2**63 - 1}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **bad)


@pytest.mark.parametrize("fields, param", [
    ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"n": 0}, "n"), ({"logit_bias": {"5": 200}}, "logit_bias.5"), ({"stop": 5}, "stop"),
    ({"prompt": 5.5}, "prompt"), ({"max_tokens": 0}, "max_tokens")])  # 0: with echo alone
def test_a_refusal_names_the_field_without_pydantics_own_names(fields, param):
    body = json.dumps({"prompt": "x", **fields}).encode()
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(body), CompletionRequest, 1 << 20))
    assert refused.value.param == param and str(refused.value).startswith(f"{param}: ")
    assert f"{param}.str" not in str(refused.value)


@pytest.mark.parametrize("fields", [{"stream_options": "yes"}, {"stream_options": [1]}])
def test_a_field_that_must_be_an_object_says_so_without_naming_a_class(fields):
    """pydantic's message named the server's own class ("a valid dictionary or instance of
    StreamOptions"), which no client knows."""
    body = json.dumps({"prompt": "x", "stream": True, **fields}).encode()
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(body), CompletionRequest, 1 << 20))
    assert str(refused.value) == "stream_options: Input should be an object"


def request_with(body: bytes) -> Request:
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [JSON_TYPE, (b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)


@pytest.mark.parametrize("depth", [100, 2000])
def test_a_body_nested_too_deeply_is_a_400(depth):
    body = b'{"prompt": "x", "unknown": ' + b"[" * depth + b"]" * depth + b"}"
    try:
        parsed = asyncio.run(parse(request_with(body), CompletionRequest, 1 << 20))
    except BadRequest as error:
        assert depth == 2000 and error.status == 400 and "nested" in str(error)
    else:
        assert depth == 100 and parsed.prompt == "x"


def test_a_tool_schema_nested_past_the_encoders_depth_is_a_400_naming_tools():
    """The parser reads a body a few frames shallower than the prompt's size check encodes
    its tools: a schema nested within that margin (977 deep, where the parser stops at 979)
    passed the one and exhausted the other, a 500. Here nested past the encoder's depth."""
    deep = {}
    for _ in range(1200):  # a body's parser stops short of this: built, then validated
        deep = {"a": deep}
    body = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": deep}}}}]})
    reader = PromptReader.__new__(PromptReader)  # its checks of sizes alone
    reader.vocab_size, reader.max_prompt_bytes = 16, 1 << 20
    with pytest.raises(BadRequest) as refused:
        reader.check_prompt_bytes(body, chat=True)
    assert refused.value.status == 400 and refused.value.param == "tools"


@pytest.mark.parametrize("prompt, prompts", [
    ("x", ["x"]), ([5, 6], [[5, 6]]), (["x", "y"], ["x", "y"]), ([[5], [6, 7]], [[5], [6, 7]]),
    ([[5, 6]], [[5, 6]])])
def test_a_completions_prompt_is_one_or_a_batch(prompt, prompts):
    assert CompletionRequest(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("fields", [{"prompt": []}, {"prompt": ["x", ""]},
                                    {"prompt": [[5], []]}, {"prompt": ["a\ud800"]},
                                    {"prompt": ["x"] * 65, "n": 2}, {"prompt": ["x", [5]]}])
def test_a_bad_batch_is_refused(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**fields)


def test_a_batch_past_the_choices_is_refused_before_its_prompts_are_read(monkeypatch):
    """2 MiB of one-letter prompts (540k) were each validated, 0.25 s of the event loop,
    then refused as too many choices: the batch's length is checked first."""
    read = []
    monkeypatch.setattr(openai_api, "encodable", lambda text, field: read.append(text) or text)
    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"prompt": ["a"] * 100_000})
    assert refused.value.errors()[0]["loc"] == ("prompt",) and read == []
    assert len(CompletionRequest(prompt=["a"] * 128).prompts()) == 128


def test_tool_calls_past_their_bound_are_refused_before_they_are_read(monkeypatch):
    """Each of 44k tool calls in 2 MiB was validated (0.17 s of the event loop); a
    conversation within the messages' bound answers fewer calls than MAX_TOOL_CALLS."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = [{"role": "assistant", "content": None, "tool_calls": [call] * 64}]
    ChatCompletionRequest(messages=calls * (MAX_TOOL_CALLS // 64))
    read = []
    monkeypatch.setattr(chat_messages, "encodable", lambda text, field: read.append(text) or text)
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({"messages": calls * (MAX_TOOL_CALLS // 64 + 1)})
    assert refused.value.errors()[0]["loc"] == ("messages",) and read == []


def test_text_content_parts_are_joined_as_vllm_joins_them():
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    chat = ChatCompletionRequest(messages=[
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": parts}])
    assert [m.content for m in chat.messages] == ["be brief", "line one\nline two"]
    assert chat.messages[1].for_template() == {"role": "user",
                                               "content": "line one\nline two"}
    # an assistant's earlier answer sent back as the openai package returns it: a refusal
    # part is its text, as vLLM reads it
    refused = {"role": "assistant", "content": [{"type": "text", "text": "no:"},
                                                {"type": "refusal", "refusal": "I can't."}]}
    assert ChatCompletionRequest(messages=[*CHAT, refused]).messages[1].content == \
        "no:\nI can't."


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                  {"type": "text"}, {"type": "text", "text": "a\ud800"},
                                  {"type": "refusal", "text": "a refusal's text is its refusal"}])
def test_a_content_part_that_is_not_text_is_refused_naming_it(part):
    body = json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()
    with pytest.raises(BadRequest) as raised:
        asyncio.run(parse(request_with(body), ChatCompletionRequest, 1 << 20))
    assert raised.value.status == 400 and raised.value.param.startswith("messages.0.content")


def test_a_json_schema_format_without_its_schema_names_that_field():
    body = ChatCompletionRequest(messages=CHAT, response_format={"type": "json_schema"})
    with pytest.raises(ValueError) as refused:
        body.constraint()
    assert refused.value.param == "response_format.json_schema"


def chunked_request(chunks: list[bytes]) -> tuple[Request, list]:
    """A request whose body comes in chunks with no Content-Length (Transfer-Encoding:
    chunked), and the chunks it has handed out."""
    sent = []

    async def receive():
        sent.append(chunks[len(sent)])
        return {"type": "http.request", "body": sent[-1], "more_body": len(sent) < len(chunks)}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [JSON_TYPE]}
    return Request(scope, receive), sent


def test_a_chunked_body_past_the_limit_is_a_413_before_it_is_all_read():
    head = b'{"prompt": "'
    request, sent = chunked_request([head] + [b"x" * 1024] * 100 + [b'"}'])
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request, CompletionRequest, 1024))  # limit 6 KiB + 64 KiB
    assert refused.value.status == 413 and len(sent) == 71  # the head and 70 KiB: past it
    request, _ = chunked_request([head, b"x" * 1024, b'"}'])
    assert len(asyncio.run(parse(request, CompletionRequest, 1024)).prompt) == 1024


@pytest.mark.parametrize("prompt", ["\x01" * (1 << 16), "\U0001F600" * (1 << 14)])
def test_a_prompt_within_max_prompt_bytes_fits_the_body_however_it_is_escaped(prompt):
    """json.dumps's default writes a control character as \\u00XX (6 bytes for 1) and an
    emoji as two \\uXXXX (12 for 4): a body of such a prompt of max_prompt_bytes was a
    413 (its limit twice max_prompt_bytes, and 64 KiB)."""
    body = json.dumps({"prompt": prompt}).encode()
    assert len(prompt.encode()) == 1 << 16 and len(body) > 3 * (1 << 16)
    assert asyncio.run(parse(request_with(body), CompletionRequest, 1 << 16)).prompt == prompt
    limit = 7 * (1 << 16)  # 6 a byte of the prompt, and 64 KiB
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request_with(b" " * (limit + 1)), CompletionRequest, 1 << 16))
    assert refused.value.status == 413 and str(refused.value) == (
        f"the request body has {limit + 1} bytes; the limit is {limit} (6 for each byte of "
        "a prompt of 65536, as escaped JSON at worst, and 65536 more)")


def a_tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("schema, field, most, item", [
    (CompletionRequest, "logit_bias", 1024, lambda i: (str(i), 1)),  # docs/serving.md's bounds
    (ChatCompletionRequest, "tools", 128, a_tool),
    (ChatCompletionRequest, "documents", 64, lambda i: {"text": f"d{i}"})])
def test_a_documented_list_bound_takes_its_most_and_refuses_one_more(schema, field, most, item):
    body = {"prompt": "x"} if schema is CompletionRequest else {"messages": CHAT}
    items = [item(i) for i in range(most + 1)]
    value = dict(items[:most]) if field == "logit_bias" else items[:most]
    assert len(getattr(schema.model_validate({**body, field: value}), field)) == most
    more = dict(items) if field == "logit_bias" else items
    with pytest.raises(ValidationError) as refused:
        schema.model_validate({**body, field: more})
    assert refused.value.errors()[0]["loc"][0] == field
