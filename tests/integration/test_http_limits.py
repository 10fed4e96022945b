"""Every field bounded, never a 500; sessions that belong to requests; admission with 429;
the optional API key; the Responses store."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.integration.conftest import LIMITED_KEY


VOCAB = 4096  # the demo pair's


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "x", "stop": ["\udfff"]}, "stop"),
    ({"prompt": "x", "top_k": 2**40}, "top_k"),
    ({"prompt": "x", "top_k": VOCAB + 1}, "top_k"),
    ({"prompt": "x", "stop": ["s" * 257]}, "stop"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),  # 64 strings at most
    ({"prompt": "x", "stop": ["s" * 256] * 4 + ["s"]}, "stop"),  # 1,024 characters in all
    ({"prompt": "x" * ((1 << 20) + 1)}, "prompt"),
    ({"prompt": [1] * 5000}, "prompt"),
])
def test_out_of_bounds_fields_are_400s(cluster, body, param):
    response = cluster.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and error["type"] == "invalid_request_error"


def test_a_lone_surrogate_in_a_chat_message_is_a_400(cluster):
    response = cluster.post("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "\ud83d"}]})
    assert response.status_code == 400, response.text


def test_a_tiny_temperature_samples_at_vllms_floor(cluster):
    """A tiny temperature is served without overflow (logits / 1e-9 would be inf): at 0.01,
    as vLLM's SamplingParams raises it, so seeded it gives 0.01's tokens (the law itself:
    tests/unit/test_sampling.py)."""
    bodies = [{"prompt": "import os\n", "max_tokens": 24, "temperature": t, "seed": 5,
               "ignore_eos": True, "return_token_ids": True} for t in (1e-9, 0.01)]
    ids = [cluster.post("/v1/completions", b).json()["choices"][0]["token_ids"] for b in bodies]
    assert ids[0] == ids[1] and len(ids[0]) == 24


PROMPTS = ["import os\n", "def main():\n", "class A:\n", "for i in range("]


def greedy(cluster, prompt, headers=None, max_tokens=48, path=""):
    response = requests.post(cluster.base_url + path + "/v1/completions", headers=headers,
                             timeout=120,
                             json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "return_token_ids": True})
    return response


def test_requests_sharing_a_client_request_id_keep_their_own_sessions(cluster):
    alone = [greedy(cluster, p).json()["choices"][0]["token_ids"] for p in PROMPTS]
    shared = {"x-request-id": "same-id"}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: greedy(cluster, p, shared), PROMPTS))
    assert [r.json()["choices"][0]["token_ids"] for r in together] == alone
    # exact even if they shared caches (a rebuild is exact): only the misses tell
    assert all(r.json()["speculative"]["cache_misses"] == 0 for r in together)
    # the header names their answers, as vLLM's (deployments.request_headers), not sessions
    assert {r.json()["id"] for r in together} == {"cmpl-same-id"}
    # and Serve's proxy echoes it (vLLM's --enable-request-id-headers, always on)
    assert {r.headers["x-request-id"] for r in together} == {"same-id"}


@pytest.mark.slow
def test_overload_gets_fast_429s_and_the_admitted_stay_exact(cluster, limited):
    """4x the running slots at once: only 200s and 429s (with Retry-After), the
    requests that waited their turn answered too, and the 200s are the target's own tokens.
    Also the API key: conftest's /limited router has 2 running slots, 2 places in its queue
    and a key."""
    expected = {p: greedy(cluster, p, max_tokens=96).json()["choices"][0]["token_ids"]
                for p in PROMPTS}
    key = {"Authorization": "Bearer " + LIMITED_KEY}
    assert greedy(cluster, PROMPTS[0], path=limited).status_code == 401
    assert greedy(cluster, PROMPTS[0], {"Authorization": "Bearer guess"},
                  path=limited).status_code == 401
    assert requests.get(cluster.base_url + limited + "/health", timeout=30).status_code == 200
    prompts = PROMPTS * 2  # 8 requests for 2 running slots
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: greedy(cluster, p, key, 96, limited), prompts))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(200) >= 4, codes  # 2 ran, 2 waited
    for prompt, response in zip(prompts, responses):
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
        else:
            assert response.json()["choices"][0]["token_ids"] == expected[prompt]
    print(f"\noverload: {len(prompts)} requests for 2 slots: {codes.count(200)} x 200, "
          f"{codes.count(429)} x 429 (slowest 429: "
          f"{max(r.elapsed.total_seconds() for r in responses if r.status_code == 429):.3f} s)")


@pytest.mark.slow
def test_a_stored_response_is_continued_and_retrieved_through_the_store_actor(cluster,
                                                                              limited):
    """The /limited router's Responses store (a Ray actor): a turn continued by its id holds
    the first exchange in its prompt; GET answers the stored Response, input_items its
    context's items a page at a time; a conversation's turn sees its items and is added to
    it, an item whose id holds "/" read on its own; truncation auto fits a conversation past the context; a chat asked to be stored is
    retrieved, listed, its messages listed and deleted; an unknown id is vLLM's 404."""
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + limited + "/v1", api_key=LIMITED_KEY)
    first = client.responses.create(model="specserve-demo", input="write a loop",
                                    max_output_tokens=8, temperature=0)
    again = client.responses.create(model="specserve-demo", input="write a loop",
                                    max_output_tokens=8, temperature=0, store=False)
    second = client.responses.create(model="specserve-demo", input="and another",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = list(client.responses.input_items.list(second.id, order="asc", limit=1))
    assert [item.type for item in items] == ["message", "message", "message"]  # paged by 1
    assert items[0].content[0].text == "write a loop" and items[1].id == first.output[0].id
    conversation = client.conversations.create(items=[  # an id of the client's, with a "/"
        {"type": "message", "role": "user", "content": "write a loop", "id": "msg_own/1"}])
    turn = client.responses.create(model="specserve-demo", input="and another",
                                   conversation=conversation.id, max_output_tokens=8,
                                   temperature=0)
    lone = client.responses.create(model="specserve-demo", input="and another",
                                   max_output_tokens=1, store=False)
    assert turn.usage.input_tokens > lone.usage.input_tokens  # the conversation's item first
    listed = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [item.type for item in listed] == ["message"] * 3  # its turn added at its end
    assert listed[-1].id == turn.output[0].id
    own = client.conversations.items.retrieve("msg_own/1", conversation_id=conversation.id)
    assert own.content[0].text == "write a loop"  # (its path's id sent as msg_own%2F1)
    client.conversations.delete(conversation.id)
    long = [{"role": role, "content": f"value_{i} = {i}\n" * 300}
            for i, role in enumerate(["user", "assistant"] * 3)]
    with pytest.raises(openai.BadRequestError):  # past the demo's 2,048 tokens
        client.responses.create(model="specserve-demo", input=[*long, *long[:1]],
                                max_output_tokens=4, store=False)
    fitted = client.responses.create(model="specserve-demo", input=[*long, *long[:1]],
                                     max_output_tokens=4, store=False, truncation="auto")
    assert fitted.truncation == "auto" and fitted.usage.input_tokens + 4 <= 2048
    chat = client.chat.completions.create(
        model="specserve-demo", messages=[{"role": "user", "content": "write a loop"}],
        max_tokens=8, temperature=0, store=True, metadata={"run": "limits"})
    assert client.chat.completions.retrieve(chat.id).choices[0].message.content == \
        chat.choices[0].message.content
    assert chat.id in [c.id for c in client.chat.completions.list(metadata={"run": "limits"})]
    assert [m.content for m in client.chat.completions.messages.list(chat.id)] == \
        ["write a loop"]
    assert client.chat.completions.delete(chat.id).deleted
    for gone in (again.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="specserve-demo", input="x", max_output_tokens=4,
                                previous_response_id="resp_unknown")


@pytest.mark.slow
def test_the_messages_api_answers_the_anthropic_client_as_the_chat_does(cluster, limited):
    """Anthropic's Messages API through the official anthropic client, behind the /limited
    router's key (as x-api-key too): a greedy message is the same chat's answer, whole and
    streamed, a system message among its messages too (vLLM 0.32's reading); count_tokens
    counts its prompt; a wrong key is Anthropic's 401."""
    import anthropic
    import openai

    ask = {"model": "specserve-demo", "max_tokens": 8,
           "messages": [{"role": "user", "content": "write a loop"}]}
    chats = openai.OpenAI(base_url=cluster.base_url + limited + "/v1", api_key=LIMITED_KEY)
    chat = chats.chat.completions.create(**ask, temperature=0)
    client = anthropic.Anthropic(base_url=cluster.base_url + limited, api_key="unused",
                                 default_headers={"x-api-key": LIMITED_KEY,
                                                  "authorization": ""})
    message = client.messages.create(**ask, extra_body={"temperature": 0})
    assert message.content[0].text == chat.choices[0].message.content
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                             chat.usage.completion_tokens)
    with client.messages.stream(**ask, extra_body={"temperature": 0}) as stream:
        assert [block.text for block in stream.get_final_message().content] == \
            [message.content[0].text]
    counted = client.messages.count_tokens(model=ask["model"], messages=ask["messages"])
    assert counted.input_tokens == chat.usage.prompt_tokens
    inline = {**ask, "messages": [{"role": "system", "content": "be brief"}, *ask["messages"]]}
    assert client.messages.create(**inline, extra_body={"temperature": 0}).content[0].text == \
        chats.chat.completions.create(**inline, temperature=0).choices[0].message.content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=cluster.base_url + limited, api_key="wrong") \
            .messages.create(**ask)


@pytest.mark.slow
def test_a_background_response_runs_is_retrieved_cancelled_and_deleted(cluster, limited):
    """The /limited router's background Responses through the official client: answered
    queued, then retrieved ended as the foreground answer (greedy); one cancelled
    while it runs ends cancelled; a deleted one is gone; background with store false is vLLM's
    400; a streamed one's events, resumed from a sequence number, are the rest of them."""
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + limited + "/v1", api_key=LIMITED_KEY)
    body = {"model": "specserve-demo", "input": "write a loop", "max_output_tokens": 12,
            "temperature": 0}
    foreground = client.responses.create(**body)
    queued = client.responses.create(**body, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline, done = time.monotonic() + 120, queued
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)  # (a deadline on the wait, not on its speed)
        done = client.responses.retrieve(queued.id)
    assert done.status == foreground.status  # incomplete: its max_output_tokens reached
    assert done.output_text == foreground.output_text
    long = client.responses.create(**{**body, "max_output_tokens": 2000}, background=True,
                                   extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(**body, background=True, store=False)
    events = list(client.responses.create(**body, background=True, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.queued"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == foreground.output_text
    resumed = list(client.responses.retrieve(events[0].response.id, stream=True,
                                             starting_after=2))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[3:]]
