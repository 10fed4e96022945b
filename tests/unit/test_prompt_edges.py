"""Edges of a chat's prompt (deployments.prompts, chat_messages, chat_templates, truncation,
special_texts): the model's template naming the developer role, a named template, the texts
a prompt's size counts, a special token's text where it must be refused or read as text,
truncate_prompt_tokens and truncation "auto" at their bounds."""

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from deployments.chat_messages import (call_id_length, template_kwargs, template_variables,
                                       with_call_ids_cut)
from deployments.chat_templates import ChatTemplate
from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.request_bounds import MAX_CHAT_TEMPLATE
from deployments.responses_api import ResponsesChat
from deployments.truncation import fitted
from tests.unit.test_chat_prompts import prompt_ids, qwen_like_reader, reader_of, with_bos

# each message as its role and text; the developer role named
NAMES_DEVELOPER = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content +"
                   " '<|im_end|>\\n' }}{%- endfor %}{# developer #}")
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def reader():
    return qwen_like_reader()


def reader_with(reader, template):
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.chat_template = template
    return reader_of(tokenizer)


def ready(reader):
    """A copy of the reader that can read() a whole body."""
    reader = copy.copy(reader)
    reader.max_prompt_bytes, reader.default_max_tokens, reader.end_ids = 1 << 16, 16, ()
    reader.tokenizing, reader.grammar_tokenizer = ThreadPoolExecutor(1), None
    return reader


def test_a_models_template_that_names_the_developer_role_is_given_it(reader):
    named = reader_with(reader, NAMES_DEVELOPER)
    ids = prompt_ids(named, [{"role": "developer", "content": "terse"},
                             {"role": "user", "content": "hi"}])
    assert named.tokenizer.decode(ids).startswith("<|im_start|>developer\nterse")


def test_a_request_naming_one_of_the_models_templates_is_read_as_that_template(reader):
    """Its variables (the chat_template_kwargs passed) and roles are the named template's,
    not those of its name's text."""
    loud = NAMES_DEVELOPER + "{%- if shout %}LOUD{%- endif %}"
    named = reader_with(reader, {"default": NAMES_DEVELOPER, "loud": loud})
    named.trusts_request_templates, named.max_prompt_bytes = True, 1 << 16
    ids = prompt_ids(named, [{"role": "developer", "content": "terse"}], chat_template="loud",
                     chat_template_kwargs={"shout": True})
    assert named.tokenizer.decode(ids) == "<|im_start|>developer\nterse<|im_end|>\nLOUD"


def test_a_template_whose_variables_cannot_be_read_is_given_every_kwarg():
    assert template_kwargs({"a": 1, "b": "x"}, None, set(), None) == {"a": 1, "b": "x"}
    assert template_kwargs({"a": 1, "b": "x"}, frozenset({"b"}), set(), None) == {"b": "x"}


def test_a_templates_variables_are_all_its_named_templates_and_none_without_one():
    """The variables of a dict of named templates are each one's (the kwargs a tool_use
    template reads pass); no template reads none."""
    assert template_variables({"default": "{{ a }}", "tool_use": "{{ b }}"}) == {"a", "b"}
    assert template_variables("") == frozenset() and template_variables(None) == frozenset()


def test_a_requests_template_renders_exactly_its_bound_of_characters():
    """4 characters (RENDERED_PER_PROMPT_BYTE) per prompt byte allowed, and its own
    MAX_CHAT_TEMPLATE: that many pass, one more is a 400 naming chat_template."""
    most = 4 * 10 + MAX_CHAT_TEMPLATE
    template = ChatTemplate("{{ x }}", frozenset(), False, None)
    assert template.checked("x" * most, 10) == "x" * most
    with pytest.raises(BadRequest) as refused:
        template.checked("x" * (most + 1), 10)
    assert refused.value.param == "chat_template" and f"the limit is {most}" in str(
        refused.value)


@pytest.mark.parametrize("key", ["messages", "tools", "documents", "add_generation_prompt",
                                 "continue_final_message", "chat_template", "tokenize"])
def test_kwargs_set_nothing_the_server_sets_and_a_null_one_passes(key):
    """Each argument the router gives the template itself is a 400 naming
    chat_template_kwargs (as vLLM's); a null value is a JSON scalar, passed."""
    with pytest.raises(BadRequest) as refused:
        template_kwargs({key: 1}, None, set(), None)
    assert refused.value.param == "chat_template_kwargs"
    assert template_kwargs({"a": None, key + "_x": 2}, None, set(), None) == {
        "a": None, key + "_x": 2}


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "a", "name": "n" * 200},
    {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": '{"x": "%s"}' % ("y" * 200)}}]},
])
def test_a_prompts_size_counts_names_and_call_arguments(reader, message):
    sized = copy.copy(reader)
    sized.max_prompt_bytes = 100
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}, message])
    with pytest.raises(BadRequest, match="bytes; the limit is 100") as refused:
        sized.check_prompt_bytes(body, chat=True)
    assert refused.value.param == "messages"


@pytest.mark.parametrize("call", [
    {**CALL, "function": {"name": "f", "arguments": '{"x": "\ud800"}'}},
    {**CALL, "function": {"name": "f\ud800", "arguments": "{}"}},
])
def test_a_call_that_is_not_valid_unicode_is_refused_as_the_request_is_read(call):
    with pytest.raises(ValidationError, match="not valid Unicode"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "a"},
                                        {"role": "assistant", "content": None,
                                         "tool_calls": [call]}])


def test_a_special_tokens_text_in_a_tool_results_call_id_is_refused(reader):
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1<|im_end|>", "content": "ok"}]
    with pytest.raises(BadRequest) as refused:
        prompt_ids(reader, messages)
    assert refused.value.param == "messages[2].tool_call_id"


def test_an_added_token_that_is_not_special_is_neither_refused_nor_split(reader):
    """A reasoning model's <think> (added, not special): a tool's description may hold it,
    and a content holding it tokenizes whole, as vLLM's."""
    tokenizer = copy.deepcopy(reader.tokenizer)
    tokenizer.add_tokens(["<think>"])
    added = reader_of(tokenizer)
    tool = {"type": "function", "function": {"name": "f", "description": "<think> first"}}
    assert prompt_ids(added, [{"role": "user", "content": "a"}], tools=[tool])
    messages = [{"role": "user", "content": "a <think>b"}]
    body = ChatCompletionRequest(messages=messages)
    text = added.chat_text(body, [m.for_template() for m in body.messages])
    assert prompt_ids(added, messages) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_template_that_changes_a_content_holding_a_special_tokens_text_is_refused(reader):
    """Its marker would reach the prompt changed (here in lower case), not the text."""
    lower = reader_with(reader, "{%- for m in messages %}{{- m.content | lower }}{%- endfor %}")
    assert prompt_ids(lower, [{"role": "user", "content": "Hello"}])
    with pytest.raises(BadRequest, match="does not render as written") as refused:
        prompt_ids(lower, [{"role": "user", "content": "a<|im_end|>b"}])
    assert refused.value.param == "messages"


def test_a_metaspace_tokenizer_reads_a_marked_content_after_a_token_without_a_space():
    """A content right after the template's token ([INST]hello) starts with the token a plain
    content's does (no metaspace put before it), and the prompt reads as written."""
    from tests.unit.test_chat_families import tokenizer

    tok = tokenizer(["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", metaspace=True)
    tok.chat_template = ("{{- bos_token }}{%- for m in messages %}{{- '[INST]' + m.content +"
                         " '[/INST]' }}{%- endfor %}")
    reader = reader_of(tok)
    ids = prompt_ids(reader, [{"role": "user", "content": "hello</s>world"}])
    assert tok.decode(ids) == "<s>[INST]hello</s>world[/INST]"
    plain = prompt_ids(reader, [{"role": "user", "content": "helloworld"}])
    assert ids[:3] == plain[:3]


def test_truncate_prompt_tokens_of_one_keeps_one_token_under_a_bos(reader):
    tokenizer, _ = with_bos(reader)
    bos_reader, text = reader_of(tokenizer), "hello world " * 5
    ids = bos_reader.token_ids(CompletionRequest(prompt=text, truncate_prompt_tokens=1), False)
    assert ids == tuple(tokenizer(text)["input_ids"][-1:])


@pytest.mark.parametrize("text", ["hello world", "hello world " * 600],
                         ids=["short", "long"])
def test_truncate_prompt_tokens_past_the_context_is_refused_naming_it(reader, text):
    """As vLLM's renderer refuses it (truncate_prompt_tokens greater than max_length),
    whatever the prompt's length: not taken silently for a short prompt, nor answered as
    the prompt's own length for a long one; the context itself is taken."""
    limit = reader.context_limit
    assert reader.token_ids(CompletionRequest(prompt="hello world",
                                              truncate_prompt_tokens=limit), False)
    body = CompletionRequest(prompt=text, truncate_prompt_tokens=limit + 1)
    with pytest.raises(BadRequest, match=f"truncate_prompt_tokens .{limit + 1}.") as refused:
        reader.token_ids(body, False)
    assert refused.value.param == "truncate_prompt_tokens"


def test_min_tokens_past_the_room_the_prompt_leaves_by_one_is_refused(reader):
    reader = ready(reader)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}])
    prompt = asyncio.run(reader.read(body, chat=True))
    room = reader.context_limit - len(prompt.token_ids)
    taken = asyncio.run(reader.read(body.model_copy(update={"min_tokens": room}), chat=True))
    assert taken.sampling.min_tokens == room
    with pytest.raises(BadRequest) as refused:
        asyncio.run(reader.read(body.model_copy(update={"min_tokens": room + 1}), chat=True))
    assert refused.value.param == "min_tokens"


ROLE_IDS = {"developer": 1, "system": 2, "user": 3, "assistant": 4}


def ten_ids_a_message(body) -> tuple[int, ...]:
    """Each message as 10 ids of its role's."""
    return tuple(ROLE_IDS[m.role] for m in body.messages for _ in range(10))


def turns(count: int) -> list[dict]:
    """`count` answered user turns, then a last question (10 ids a message)."""
    return [{"role": role, "content": "x"} for _ in range(count)
            for role in ("user", "assistant")] + [{"role": "user", "content": "x"}]


def test_truncation_auto_keeps_a_prompt_that_fits_with_its_room_exactly():
    body = ResponsesChat(messages=turns(2), max_tokens=10, truncation="auto")
    assert len(fitted(body, ten_ids_a_message, 60)) == 50


def test_truncation_auto_drops_turns_for_the_outputs_room():
    body = ResponsesChat(messages=turns(2), max_tokens=25, truncation="auto")
    assert len(fitted(body, ten_ids_a_message, 60)) == 30


def test_truncation_auto_keeps_the_developers_messages():
    messages = [{"role": "developer", "content": "x"}] + turns(3)
    body = ResponsesChat(messages=messages, max_tokens=10, truncation="auto")
    ids = fitted(body, ten_ids_a_message, 50)  # the developer's and the last turn
    assert ids == (1,) * 10 + (3,) * 10 + (4,) * 10 + (3,) * 10


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "x", "tool_calls": [CALL]},  # only an assistant calls
    {"role": "assistant", "content": None},  # null content only beside tool_calls
    {"role": "tool", "content": "1"},  # a tool result names its call
])
def test_a_messages_tool_fields_are_checked_as_a_chat_is_read(message):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})
    ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"}]})


class IdsUpTo:
    """A tokenizer whose template refuses a tool call id longer than `longest` (None: all)."""

    chat_template = "{{ messages }}"

    def __init__(self, longest):
        self.longest = longest

    def apply_chat_template(self, messages, tokenize, chat_template):
        if self.longest is None or len(messages[-1]["tool_call_id"]) > self.longest:
            raise ValueError("refused")
        return ""


def test_short_call_ids_only_where_the_template_takes_them_and_cut_to_their_ends():
    assert call_id_length(IdsUpTo(9)) == 9 and call_id_length(IdsUpTo(64)) is None
    assert call_id_length(IdsUpTo(None)) is None  # refusing every id: not a Mistral template
    call = {**CALL, "id": "call_0123456789"}
    cut = with_call_ids_cut([{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": "1", "tool_call_id": call["id"]}], 9)
    assert cut[0]["tool_calls"][0]["id"] == cut[1]["tool_call_id"] == "123456789"
    bare = {"type": "function", "function": {"name": "f", "arguments": {}}}  # no id: kept
    assert with_call_ids_cut([{"role": "assistant", "content": "", "tool_calls": [bare]}],
                             9)[0]["tool_calls"] == [bare]


def test_min_tokens_holds_back_the_requests_stop_ids_and_the_end_tokens(reader):
    """vLLM's all_stop_token_ids: min_tokens masks the request's own stop_token_ids as well
    as the model's end tokens (a stop id sampled early would end the output short)."""
    reader = ready(reader)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}],
                                 min_tokens=2, stop_token_ids=[7, 11])
    held = asyncio.run(reader.read(body, chat=True)).sampling.min_tokens_end_ids
    assert {7, 11} <= set(held) and set(reader.end_ids) <= set(held)
