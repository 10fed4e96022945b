"""vLLM's `POST /v1/chat/completions/batch`: a chat whose `messages` is a list of
conversations, each served as /v1/chat/completions serves it alone, all at once; the answer
is one chat.completion with one choice a conversation (indexed in their order) and their
usage added up.

As vLLM's (its BatchChatCompletionRequest): the chat's fields apply to every conversation
(the `seed` too: each conversation draws as it would alone with that seed); `n` must be 1;
no beam search, no tools (`tool_choice` "none" alone); `max_tokens` bounds each
conversation's output against its own prompt, as its chat's does. A stream, asked for, is
refused here (vLLM's takes the field as unknown and answers whole), as are prompt_logprobs,
which a batch's answer has no place for; `store` is not read (vLLM's has none). The answer's
id is the chat's (`chatcmpl-...`; `chatcmpl-<request_id>` where the batch gives vLLM's
request_id, or its X-Request-Id header: deployments.request_headers), each conversation's
pool sessions `<the router's id>_<index>`, and the conversations are admitted together, as a
chat's n choices are (deployments.admission).
"""

import asyncio
import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import Request
from pydantic import Field, ValidationError, model_validator

from deployments.chat_messages import ChatMessage
from deployments.choices import all_or_none
from deployments.ingress import (
    BadRequest,
    error_response,
    invalid_body,
    json_answer,
    parse,
    pool_failure,
    unauthorized,
)
from deployments.openai_api import ChatCompletionRequest
from deployments.request_bounds import MAX_CHOICES, MAX_MESSAGES
from deployments.request_headers import header_request_id
from deployments.responses import completion_body
from deployments.tools import FieldError
from speculative.stats import SpecStats
from speculative.types import PoolUnavailable

BATCH_PATH = "/v1/chat/completions/batch"

# what a batch does not serve, given at any value but these (vLLM's refusals, its words for
# the two it refuses: beam search, n; the others are specserve's)
UNBATCHED = {
    "use_beam_search": ((None, False), "Batch chat completions do not support beam search. "
                                       "Please set `use_beam_search` to False."),
    "n": ((None, 1), "Batch chat completions do not support `n > 1`. Please set `n` to 1."),
    "stream": ((None, False), "Batch chat completions do not support streaming. Please set "
                              "`stream` to False."),
    "tools": ((None, []), "Batch chat completions do not support tools."),
    "tool_choice": ((None, "none"), "Batch chat completions take `tool_choice` \"none\" "
                                    "alone."),
    "prompt_logprobs": ((None, False), "Batch chat completions do not return prompt "
                                       "logprobs."),
}


class BatchChatCompletionRequest(ChatCompletionRequest):
    """The body's schema, as the OpenAPI document gives it (vLLM's name): a chat's fields,
    `messages` a list of conversations. Parsed by BatchChatRequest, each conversation as a
    chat's body (the chat's checks of its messages are that body's)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]] \
        = Field(min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="after")
    def one_ending(self):  # (the chat's, of its one conversation: each conversation's)
        raise ValueError("parsed by deployments.chat_batch.BatchChatRequest")


@dataclass(frozen=True)
class ChatBatch:
    """The batch's conversations, each its own chat's body (the batch's other fields)."""

    chats: tuple[ChatCompletionRequest, ...]


class BatchChatRequest:
    """The batch's body: its refusals, then each conversation validated as a chat's body,
    a refusal naming it (`messages.<index>`)."""

    @staticmethod
    def model_validate(data) -> ChatBatch:
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        for field, (served, message) in UNBATCHED.items():
            value = data.get(field)  # null: the default, as the chat's fields
            if value is not None and not any(type(value) is type(s) and value == s
                                             for s in served):  # (1 is not true)
                raise BadRequest(message, param=field)
        conversations = data.get("messages")
        if not isinstance(conversations, list) or not conversations:
            raise BadRequest("messages: a non-empty list of conversations (each a list of "
                             "messages)", param="messages")
        if len(conversations) > MAX_CHOICES:
            raise BadRequest(f"messages: a batch takes up to {MAX_CHOICES} conversations, "
                             f"not {len(conversations)}", param="messages")
        return ChatBatch(tuple(conversation_chat(data, index, messages)
                               for index, messages in enumerate(conversations)))


def conversation_chat(data: dict, index: int, messages) -> ChatCompletionRequest:
    """Conversation `index` as a chat's body; a refusal of its messages names it."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages.{index}: a conversation is a non-empty list of messages",
                         param=f"messages.{index}")
    try:
        return ChatCompletionRequest.model_validate({**data, "messages": messages})
    except ValidationError as error:
        raise in_conversation(invalid_body(error), index) from None


def in_conversation(error: BadRequest, index: int) -> BadRequest:
    """A chat's refusal naming its `messages` (or a message), named in the batch's; of
    another field (its max_tokens past its prompt's context), said of the conversation."""
    param = error.param or ""
    if param != "messages" and not param.startswith("messages."):
        return BadRequest(f"messages.{index}: {error}", error.status, error.param,
                          error.headers, error.code)
    named = f"messages.{index}{param.removeprefix('messages')}"
    message = str(error)
    if message.startswith(param):
        message = named + message.removeprefix(param)
    return BadRequest(message, error.status, named, error.headers, error.code)


async def batch_answer(router, request: Request):
    """The batch served on the router's chat path (Router.plan_one, Router.choices), each
    conversation a chat of its own, all admitted on one ticket (as a chat's n choices)."""
    if refused := unauthorized(request, router.api_key):
        return refused
    try:
        batch = await parse(request, BatchChatRequest, router.args.max_prompt_bytes)
        first = header_request_id(request, batch.chats[0])  # its request_id names the batch
        router.check_model(first)
        router.admission.check(len(batch.chats), first.priority, "messages",
                               "messages: the batch's {} conversations")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        plans = [await planned(router, f"{request_id}_{i}", chat, i, len(batch.chats) - 1)
                 for i, chat in enumerate(batch.chats)]
        ticket = await router.admission.wait_turn(sum(len(p.choices) for p in plans),
                                                  first.priority)
    except (BadRequest, ValueError) as error:
        error = error if isinstance(error, BadRequest) else \
            BadRequest(str(error), param=getattr(error, "param", None))  # a FieldError's
        return error_response(error)
    try:
        runs = [router.choices(chat, plan, None, ticket, True)
                for chat, plan in zip(batch.chats, plans)]
        finished = await all_or_none(run.finished() for run in runs)
        loop = asyncio.get_running_loop()
        answer_id = request_id if first.request_id is None else f"chatcmpl-{first.request_id}"
        body = await loop.run_in_executor(router.rendering, batch_body, answer_id, runs,
                                          finished)
        return await loop.run_in_executor(router.rendering, json_answer, body)
    except PoolUnavailable as error:  # a pool's, as the chat's
        return error_response(pool_failure(error, request_id))
    finally:
        ticket.release()


async def planned(router, request_id: str, chat: ChatCompletionRequest, index: int,
                  others: int):
    """Conversation `index` planned as its chat is (its prompt read, its max_tokens bounded
    by its own prompt), beside the `others` conversations' choices (an adaptive K's load)."""
    try:
        return await router.plan_one(request_id, chat, True, others)
    except FieldError as error:
        raise in_conversation(BadRequest(str(error), param=error.param), index) from None
    except BadRequest as error:
        raise in_conversation(error, index) from None


def batch_body(request_id: str, runs: list, finished: list) -> dict:
    """One chat.completion of the conversations' answers: each one's choice at its index,
    their usage and speculative statistics added up."""
    answers = [run.whole_body(*done) for run, done in zip(runs, finished)]
    choices = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    stats = SpecStats()
    for run, (done, _) in zip(runs, finished):
        stats.add(run.plan.merged_stats(done))
    usage = added([answer["usage"] for answer in answers])
    return completion_body(request_id, runs[0].model, choices, usage, stats, True,
                           runs[0].created)


def added(usages: list[dict]) -> dict:
    """Usages added up, field by field (their details' too)."""
    total: dict = {}
    for usage in usages:
        for name, value in usage.items():
            total[name] = added([total.get(name, {}), value]) if isinstance(value, dict) \
                else total.get(name, 0) + value
    return total


class ChatBatchRoute:
    """The Router's batch route (deployments.router registers it on its app, before the
    stored chats' /v1/chat/completions{path}, which would take its path)."""

    async def chat_completions_batch(self, request: Request):
        """vLLM's batch of chats (deployments.chat_batch), behind the API key."""
        return await batch_answer(self, request)
