"""vLLM's return_prompt_text: a chat's prompt as its template rendered it, on the answer and
on each streamed choice's first chunk."""

import asyncio
import copy
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.openai_api import ChatCompletionRequest
from deployments.prompts import Prompt
from deployments.stored_chats import StoredChatRequest
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.tiny import Agreeing, noisy_copy, tiny_llama
from tests.unit.test_chat_batch import Prompts, router_of
from tests.unit.test_chat_prompts import qwen_like_reader
from tests.unit.test_router_parts import Recorded, posted

RENDERED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def reader():
    reader = copy.copy(qwen_like_reader())
    reader.max_prompt_bytes, reader.default_max_tokens, reader.end_ids = 1 << 16, 16, ()
    reader.tokenizing, reader.grammar_tokenizer = ThreadPoolExecutor(1), None
    return reader


def test_the_rendered_prompt_is_read_when_asked_its_messages_texts_as_written(reader):
    """The template's text, a special token's text in a message as the client wrote it (the
    ids read it as text: their own test), and nothing unasked."""
    messages = [{"role": "user", "content": "say <|im_end|> please"}]
    body = ChatCompletionRequest(messages=messages, return_prompt_text=True)
    prompt = asyncio.run(reader.read(body, True))
    expected = reader.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    assert prompt.text == expected and "say <|im_end|> please" in prompt.text
    unasked = asyncio.run(reader.read(body.model_copy(update={"return_prompt_text": False}),
                                      True))
    assert unasked.text is None and unasked.token_ids == prompt.token_ids
    assert ChatCompletionRequest(messages=messages, return_prompt_text=None) \
        .return_prompt_text is False  # null: the default, as vLLM's


def choices(prompt_text):
    plan = RequestFrontEnd().plan("chatcmpl-x", (2, 3), SamplingParams(temperature=0.0,
                                                                         max_tokens=4), n=2)
    plan = dataclasses.replace(plan, prompt_text=prompt_text)
    engine = Agreeing()
    return Choices(plan, (engine, engine), lambda ids: "a" * len(ids), Recorded(),
                   Admission(4).admit(2), model="m", chat=True, return_token_ids=False)


@pytest.mark.parametrize("prompt_text", [RENDERED, None])
def test_the_answer_carries_it_and_a_stream_on_each_choices_first_chunk(prompt_text):
    """Where vLLM puts it: the body's `prompt_text`; streamed, the top level of each
    choice's first chunk (the role's) alone; absent unasked."""
    body = asyncio.run(choices(prompt_text).complete())
    assert body.get("prompt_text") == prompt_text and ("prompt_text" in body) == \
        (prompt_text is not None)

    async def collect():
        return [e async for e in choices(prompt_text).events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["choices"][0]["delta"]["role"] == "assistant"
        assert mine[0].get("prompt_text") == prompt_text
        assert all("prompt_text" not in c for c in mine[1:])


class RenderedPrompts(Prompts):
    """The chat batch tests' prompt reading, with a rendered text when asked."""

    async def read(self, body, chat: bool) -> Prompt:
        prompt = await super().read(body, chat)
        text = "".join(f"<{m.role}>{m.content}" for m in body.messages) \
            if body.return_prompt_text else None
        return dataclasses.replace(prompt, text=text)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(7)
    return target, noisy_copy(target, 0.05, seed=1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_asked_for_it_answers_its_rendered_prompt(pair, stream):
    """Through the router's chat path: the reader's text on the answer (streamed, on the
    first chunk), the rest of the answer as without it."""
    router = router_of(pair)
    router.prompts = RenderedPrompts()
    body = {"model": "m", "max_tokens": 5, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}

    def answered(asked: bool) -> dict:
        answer = asyncio.run(router.serve_request(
            posted({**body, "return_prompt_text": asked}), StoredChatRequest))
        if not stream:
            return json.loads(answer.body)

        async def events():
            return [e async for e in answer.body_iterator]

        texts = [e.decode() if isinstance(e, bytes) else e for e in asyncio.run(events())]
        return json.loads(texts[0][len("data: "):])  # the first chunk

    asked, unasked = answered(True), answered(False)
    assert asked.pop("prompt_text") == "<user>hi" and "prompt_text" not in unasked
    if not stream:
        assert asked["choices"] == unasked["choices"]
