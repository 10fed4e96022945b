"""vLLM 0.32's extensions beyond the OpenAI API, over HTTP on the shared deployment, exact
under speculation: repetition_detection, stream_interval, the batch of chats; a thinking
budget's refusal without a reasoning parser."""

import pytest

from tests.integration.test_http_features import PROMPTS, SPECULATION, complete


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")


def test_repetition_detection_ends_where_k0_ends_and_stream_interval_joins(client):
    """vLLM's repetition_detection on a prompt the demo target repeats: its output ends
    (finish_reason "repetition") at the same token with each speculation setting as at
    K = 0; vLLM's stream_interval's chunks join into the same text."""
    detect = {"repetition_detection": {"max_pattern_size": 12, "min_count": 3},
              "return_token_ids": True, "ignore_eos": True}
    prompt = "x = 1\n" * 6
    alone = complete(client, prompt, {"extra_body": detect}, {"num_speculative_tokens": 0})
    ended = alone.choices[0]
    assert ended.finish_reason == "repetition" and len(ended.token_ids) < 40
    for name, speculation in SPECULATION.items():
        spec = complete(client, prompt, {"extra_body": detect}, speculation).choices[0]
        assert (spec.token_ids, spec.finish_reason) == (ended.token_ids, "repetition"), name
    chunks = list(client.completions.create(
        model="specserve-demo", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
        extra_body={"stream_interval": 5, "num_speculative_tokens": 3}))
    whole = complete(client, PROMPTS[0], {}, {"num_speculative_tokens": 3}).choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert len(chunks) < 40 // 5 + 4  # about one chunk a 5 tokens (a round may pass more)


def test_a_batch_of_chats_answers_each_conversation_as_its_own_chat(cluster):
    """vLLM's /v1/chat/completions/batch on the served Router (its route bound there, ahead
    of the stored chats' catch-all): choice i is conversation i's own greedy chat."""
    conversations = [[{"role": "user", "content": "Parse a config file."}],
                     [{"role": "user", "content": "write a loop"}]]
    ask = {"max_tokens": 12, "temperature": 0, "num_speculative_tokens": 4}
    batch = cluster.post("/v1/chat/completions/batch", {**ask, "messages": conversations})
    assert batch.status_code == 200, batch.text
    alone = [cluster.post("/v1/chat/completions", {**ask, "messages": messages}).json()
             for messages in conversations]
    assert [choice["message"]["content"] for choice in batch.json()["choices"]] == \
        [answer["choices"][0]["message"]["content"] for answer in alone]
    assert batch.json()["usage"]["completion_tokens"] == \
        sum(answer["usage"]["completion_tokens"] for answer in alone)


def test_a_thinking_budget_without_a_reasoning_parser_is_vllms_400(cluster):
    """The demo router has no reasoning_parser (vLLM's reasoning config): vLLM's refusal."""
    response = cluster.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 8})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "thinking_token_budget"
