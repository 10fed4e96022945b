"""vLLM's POST /v1/chat/completions/batch on the router's chat path, without Ray: each
conversation's choice is the answer its own /v1/chat/completions gives (greedy, and sampled
with a seed), at its index, usage added up, admitted as a chat's n choices are; and its
refusals, each naming its field."""

import asyncio
import json
from types import MethodType, SimpleNamespace

import pytest
from starlette.routing import Match

from deployments.admission import Admission
from deployments.chat_batch import BATCH_PATH, ChatBatchRoute
from deployments.prompts import Prompt, PromptReader
from deployments.router import Router, app
from deployments.router_args import RouterArgs
from deployments.stored_chats import StoredChatRequest
from drafter.model import ModelDrafter
from speculative.frontend import RequestFrontEnd
from tests.tiny import noisy_copy, tiny_llama
from tests.unit.test_router_parts import posted
from verifier.engine import ModelVerifier

CONVERSATIONS = [[{"role": "user", "content": "hello there"}],
                 [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "what is a tree?"}],
                 [{"role": "user", "content": "zz"}]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(7)
    return target, noisy_copy(target, 0.05, seed=1)


class Prompts:
    """The prompt reading a chat's is, standing in: each message's characters as ids over a
    64-token vocabulary, max_tokens by default the context's rest after the prompt."""

    context_limit = 128

    async def read(self, body, chat: bool) -> Prompt:
        ids = tuple(2 + ord(c) % 62 for m in body.messages for c in f"{m.role}{m.content}")
        sampling = body.sampling(self.context_limit)  # cut to the room left, or refused:
        return Prompt(ids, PromptReader.within_context(self, body, sampling, len(ids)), ())

    def reported_stop_ids(self, body):
        return ()


def router_of(pair, max_running: int = 8, api_key: str | None = None) -> SimpleNamespace:
    """A Router's request path (its own methods) over in-process pools of a tiny target and
    a noisy copy of it as the drafter (drafts rejected now and then: speculation at work)."""
    target, draft = pair
    pools = (ModelDrafter(draft), ModelVerifier(target))

    def decode(ids):
        return "".join(f"<{i}>" for i in ids)

    router = SimpleNamespace(
        api_key=api_key, token_bytes=None, admission=Admission(max_running),
        think_tokens=None, responses_store=None, rendering=None, front_end=RequestFrontEnd(),
        metrics=SimpleNamespace(record_choice=lambda *choice: None),
        args=RouterArgs(served_model_name="m"), decode=decode, tool_decode=decode,
        special_decode=decode, prompts=Prompts(), pools=lambda kind=None: pools)
    for name in ("check_model", "plan", "plan_one", "choices", "prompt_answer", "reasoning",
                 "tool_use", "serve_request"):
        setattr(router, name, MethodType(getattr(Router, name), router))
    return router


def batched(router, body: dict) -> tuple[int, dict]:
    answer = asyncio.run(ChatBatchRoute.chat_completions_batch(router, posted(body)))
    assert router.admission.running == 0  # its slots given back
    return answer.status_code, json.loads(answer.body)


def alone(router, body: dict, messages: list) -> dict:
    """The chat's own answer to one conversation, on /v1/chat/completions' path."""
    answer = asyncio.run(router.serve_request(posted({**body, "messages": messages}),
                                              StoredChatRequest))
    assert answer.status_code == 200
    return json.loads(answer.body)


def check_each_alone(pair, body: dict) -> dict:
    """The batch's answer, its choice i checked against conversation i's own chat's."""
    status, answer = batched(router_of(pair), {**body, "messages": CONVERSATIONS})
    assert status == 200 and answer["object"] == "chat.completion"
    assert answer["id"].startswith("chatcmpl-")
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    singles = [alone(router_of(pair), body, c) for c in CONVERSATIONS]
    for choice, single in zip(answer["choices"], singles):
        assert choice == single["choices"][0] | {"index": choice["index"]}
    return answer


BODY = {"model": "m", "max_tokens": 12, "return_token_ids": True,
        "num_speculative_tokens": 3}


def test_each_choice_is_its_conversations_own_chat_greedy(pair):
    answer = check_each_alone(pair, {**BODY, "temperature": 0, "logprobs": True,
                                     "top_logprobs": 2})
    outputs = [tuple(choice["token_ids"]) for choice in answer["choices"]]
    assert len(set(outputs)) == 3  # the conversations' own outputs: in their order
    stats = answer["speculative"]  # speculation at work: drafts accepted and rejected
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_a_seeded_batch_draws_each_conversation_as_it_would_alone(pair):
    """As vLLM's: every conversation is a request with the batch's seed (not one derived
    per conversation, as a chat's n choices' are)."""
    answer = check_each_alone(pair, {**BODY, "temperature": 1.0, "seed": 11})
    status, other = batched(router_of(pair), {**BODY, "temperature": 1.0, "seed": 12,
                                              "messages": CONVERSATIONS})
    assert status == 200 and other["choices"] != answer["choices"]  # the seed is read
    status, twice = batched(router_of(pair), {**BODY, "temperature": 1.0, "seed": 11,
                                              "messages": [CONVERSATIONS[0]] * 2})
    first, second = twice["choices"]
    assert first == answer["choices"][0] and second == first | {"index": 1}


def test_usage_adds_up_the_conversations(pair):
    body = {**BODY, "temperature": 0, "max_tokens": 5}
    status, answer = batched(router_of(pair), {**body, "messages": CONVERSATIONS})
    singles = [alone(router_of(pair), body, c)["usage"] for c in CONVERSATIONS]
    usage = answer["usage"]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[field] == sum(single[field] for single in singles)
    assert usage["completion_tokens"] == 15
    assert answer["speculative"]["num_emitted_tokens"] == 15  # every conversation's rounds


@pytest.mark.parametrize("fields, param, message", [
    ({"messages": []}, "messages", "non-empty list of conversations"),
    ({}, "messages", "non-empty list of conversations"),
    ({"messages": CONVERSATIONS[0]}, "messages.0", "a conversation is a non-empty list"),
    ({"messages": [CONVERSATIONS[0], []]}, "messages.1", "a conversation is a non-empty"),
    ({"messages": [CONVERSATIONS[0], [{"role": "user", "content": "a"}, {"content": "x"}]]},
     "messages.1.1.role", "messages.1.1.role: Field required"),  # the chat's messages.1.role
    ({"stream": True}, "stream", "do not support streaming"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ({"tool_choice": "auto"}, "tool_choice", "\"none\" alone"),
    ({"n": 2}, "n", "Batch chat completions do not support `n > 1`"),
    ({"n": True}, "n", "Batch chat completions do not support `n > 1`"),
    ({"use_beam_search": True}, "use_beam_search", "do not support beam search"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt logprobs"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"model": "other"}, "model", "other"),
])
def test_a_batch_it_does_not_serve_is_refused_naming_the_field(pair, fields, param, message):
    body = {"model": "m", "messages": CONVERSATIONS, **fields}
    if not fields:
        del body["messages"]
    status, answer = batched(router_of(pair), body)
    assert status == (404 if param == "model" else 400)
    assert answer["error"]["param"] == param and message in answer["error"]["message"]


def test_max_tokens_is_bounded_by_each_conversations_own_prompt(pair):
    """As each one's chat: the context's rest after its own prompt by default, and a length
    asked for cut to it; one past the context refuses the batch, saying which conversation
    (the first planned)."""
    long = [{"role": "user", "content": "x" * 100}]  # 104 of the 128 tokens (the other: 6)
    status, answer = batched(router_of(pair), {**BODY, "max_tokens": None, "temperature": 0,
                                               "messages": [CONVERSATIONS[2], long]})
    assert status == 200
    assert [c["finish_reason"] for c in answer["choices"]] == ["length"] * 2
    assert answer["usage"]["completion_tokens"] == (128 - 6) + (128 - 104)
    status, answer = batched(router_of(pair), {**BODY, "max_tokens": 30, "temperature": 0,
                                               "messages": [CONVERSATIONS[2], long]})
    assert status == 200 and answer["usage"]["completion_tokens"] == 30 + (128 - 104)
    status, answer = batched(router_of(pair), {**BODY, "max_tokens": 129,
                                               "messages": [CONVERSATIONS[2], long]})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert answer["error"]["message"].startswith("messages.0: ")


def test_the_defaults_asked_for_explicitly_are_served(pair):
    fields = {"stream": False, "tools": [], "tool_choice": "none", "n": 1,
              "use_beam_search": False, "prompt_logprobs": None}
    status, answer = batched(router_of(pair), {**BODY, **fields, "temperature": 0,
                                               "messages": CONVERSATIONS[:1]})
    assert status == 200 and len(answer["choices"]) == 1


def test_its_conversations_are_admitted_together_as_a_chats_n_choices(pair):
    """Two run at once: a batch of three is refused as a chat of n = 3 is (one at a time,
    each would run), naming its conversations."""
    router = router_of(pair, max_running=2)
    status, answer = batched(router, {**BODY, "messages": CONVERSATIONS})
    assert status == 400 and answer["error"]["param"] == "messages"
    assert "3 conversations" in answer["error"]["message"]
    status, _ = batched(router, {**BODY, "messages": CONVERSATIONS[:2]})
    assert status == 200


def test_a_batch_needs_the_api_key_as_the_chat_does(pair):
    status, answer = batched(router_of(pair, api_key="k"), {**BODY, "messages": CONVERSATIONS})
    assert status == 401


def test_the_batch_path_is_the_batchs_not_a_stored_chats():
    """/v1/chat/completions{path} (stored chats: POST /{id} sets its metadata) would take
    it: the batch's route comes first."""
    from ray.serve._private.http_util import _walk_fastapi_routes  # (Serve's, as it binds)

    scope = {"type": "http", "method": "POST", "path": BATCH_PATH}
    routes = [route for route, _, _ in _walk_fastapi_routes(app)]  # in the order tried
    route = next(r for r in routes if r.matches(scope)[0] == Match.FULL)
    assert route.endpoint is ChatBatchRoute.chat_completions_batch
    assert issubclass(Router, ChatBatchRoute)  # Serve's ingress binds it to the Router
