"""The Messages API's system messages among the messages, as vLLM 0.32 reads them: each a
system message in its place (text blocks joined, Claude Code's billing header dropped, an
empty one none), or, where the model's template wants the system prompt first (probed once
per router), merged into the system prompt; count_tokens counts the prompt so rendered, and
any block but text in one is a 400 naming it, as in the system prompt."""

import asyncio
import json

import pytest

from deployments.chat_templates import wants_system_first
from deployments.openai_api import ChatCompletionRequest
from deployments.router import Router
from tests.unit.test_chat_prompts import QWEN_LIKE, qwen_like_reader
from tests.unit.test_messages_api import (  # noqa: F401 (reader: the fixture)
    HI,
    created,
    exact_router,
    messages_router,
    posted_to,
    reader,
)
from tests.unit.test_messages_request import chat_of
from tests.unit.test_router_parts import posted

# Qwen3.5's way: a system message after the first raises
SYSTEM_FIRST = (
    "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
BILLING = "x-anthropic-billing-header: cc_version=2.1; cch=1f2e;"
TURNS = [{"role": "user", "content": "hello world"},
         {"role": "system", "content": [{"type": "text", "text": BILLING},
                                        {"type": "text", "text": " answer in "},
                                        {"type": "text", "text": "French"}]},
         {"role": "user", "content": "answer"}]


def chat_ids(router, fed: list, messages: list[dict]) -> list[int]:
    """The ids the chat route feeds for `messages` (a 400 where the template refuses them)."""
    answer = asyncio.run(Router.serve_request(router, posted({
        "model": "m", "messages": messages, "max_tokens": 50}), ChatCompletionRequest))
    assert answer.status_code == 200, json.loads(answer.body)
    return fed[-1]


def counted(router, body: dict) -> int:
    status, answer = posted_to(router, {"model": "m", **body}, Router.count_tokens)
    assert status == 200
    return answer["input_tokens"]


def test_a_system_message_is_one_in_its_place():
    """Its text blocks joined with nothing between, billing headers dropped (a string's
    too, not the system prompt's string: vLLM's), one with no text adds no message."""
    chat = chat_of({"system": BILLING, "messages": [
        *TURNS, {"role": "system", "content": BILLING}, {"role": "system", "content": []},
        {"role": "system", "content": ""}, {"role": "assistant", "content": "bonjour"}]})
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": BILLING}, TURNS[0],
        {"role": "system", "content": " answer in French"}, TURNS[2],
        {"role": "assistant", "content": "bonjour"}]


def test_a_message_is_fed_the_chats_prompt_with_the_system_message_in_place(reader):
    router, fed = exact_router(reader)
    assert not reader.system_first  # QWEN_LIKE writes a later system message where it is
    messages = [{"role": "system", "content": "be brief"}, TURNS[0],
                {"role": "system", "content": " answer in French"}, TURNS[2]]
    ids = chat_ids(router, fed, messages)
    created(router, max_tokens=50, system="be brief", messages=TURNS)
    assert fed[-1] == ids
    assert counted(router, {"system": "be brief", "messages": TURNS}) == len(ids)


def system_first_reader():
    reader = qwen_like_reader()
    reader.tokenizer.chat_template = SYSTEM_FIRST
    return reader


def test_a_template_that_wants_the_system_prompt_first_is_probed_once_per_reader():
    """Rendered as a chat is, with no tools and with tools (a model's named templates)."""
    reader = qwen_like_reader()
    assert not wants_system_first(reader.tokenizer) and not reader.system_first
    assert system_first_reader().system_first
    reader.tokenizer.chat_template = {"default": QWEN_LIKE, "tool_use": SYSTEM_FIRST}
    assert wants_system_first(reader.tokenizer)
    assert not reader.system_first  # (probed once: the reader's template does not change)


def test_system_messages_are_merged_into_the_system_prompt_where_it_must_come_first(reader):
    """As vLLM merges them: appended to the system prompt with nothing between (the
    chat's own request with a later system message is refused by such a template)."""
    reader.tokenizer.chat_template = SYSTEM_FIRST
    router, fed = exact_router(reader)
    later = [{"role": "system", "content": "be brief"}, TURNS[0],
             {"role": "system", "content": "x"}, TURNS[2]]
    status, answer = posted_to(router, {"model": "m", "max_tokens": 5, "messages": later},
                               lambda router, request: Router.serve_request(
                                   router, request, ChatCompletionRequest))
    assert status == 400 and "System message must be at the beginning" in str(answer)
    merged = [{"role": "system", "content": "be brief answer in French"}, TURNS[0], TURNS[2]]
    ids = chat_ids(router, fed, merged)
    created(router, max_tokens=50, system="be brief", messages=TURNS)
    assert fed[-1] == ids
    assert counted(router, {"system": "be brief", "messages": TURNS}) == len(ids)
    alone = chat_ids(router, fed, [{"role": "system", "content": " answer in French"},
                                   TURNS[0], TURNS[2]])
    created(router, max_tokens=50, messages=TURNS)  # no system prompt: the merged one alone
    assert fed[-1] == alone and counted(router, {"messages": TURNS}) == len(alone)


@pytest.mark.parametrize("content, named", [
    ([{"type": "image", "source": {"type": "url", "url": "http://x"}}],
     "messages[1].content[0].type"),
    ([{"type": "text", "text": "a"}, {"type": "thinking", "thinking": "b"}],
     "messages[1].content[1].type"),
    ([{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "now"}}],
     "messages[1].content[0].type"),
    ([{"type": "text"}], "messages[1].content[0].text"),
    ({"text": "a"}, "messages[1].content"),
    ("\ud800", "messages[1]: content"),  # (the chat's refusal, named back)
])
def test_what_a_system_message_may_not_hold_is_a_400_naming_it(content, named):
    """As the system prompt's: text blocks alone (vLLM skips the others; a tool_addition it
    applies is not served here), in place or merged (named as given)."""
    for first in (False, True):
        router = messages_router()
        router.prompts.system_first = first
        status, answer = posted_to(router, {"model": "m", "max_tokens": 10, "messages": [
            HI[0], {"role": "system", "content": content}]})
        assert status == 400 and answer["type"] == "error"
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["message"].startswith(named)
