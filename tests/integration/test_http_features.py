"""What OpenAI clients send beyond a prompt, over HTTP through the official openai client,
exact under speculation: penalties and logprobs."""

import pytest

PROMPTS = ["def main():\n", "import os\n", "for i in range("]
PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.0},
    "repetition": {"extra_body": {"repetition_penalty": 1.3}},
}
SPECULATION = {"K3": {"num_speculative_tokens": 3},
               "auto-pipelined": {"num_speculative_tokens": "auto", "pipelined": True},
               "ngram": {"num_speculative_tokens": 3, "drafter": "ngram"}}


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")


def complete(client, prompt: str, penalty: dict, speculation: dict):
    extra = {**penalty.get("extra_body", {}), **speculation}
    fields = {key: value for key, value in penalty.items() if key != "extra_body"}
    return client.completions.create(model="specserve-demo", prompt=prompt, max_tokens=40,
                                     temperature=0, extra_body=extra, **fields)


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalised_greedy_equals_the_target_alone_and_differs_from_unpenalised(client,
                                                                              penalty):
    changed = 0
    for prompt in PROMPTS:
        alone = complete(client, prompt, PENALTIES[penalty], {"num_speculative_tokens": 0})
        for name, speculation in SPECULATION.items():
            spec = complete(client, prompt, PENALTIES[penalty], speculation)
            assert spec.choices[0].text == alone.choices[0].text, (prompt, penalty, name)
        plain = complete(client, prompt, {}, {"num_speculative_tokens": 0})
        changed += plain.choices[0].text != alone.choices[0].text
    assert changed > 0, "the penalty changed no output"


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5),
                                          ("frequency_penalty", -2.1),
                                          ("repetition_penalty", 0)])
def test_out_of_range_penalties_get_400(cluster, field, value):
    response = cluster.post("/v1/completions", {"prompt": "x", field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field)


def test_logprobs_under_speculation_equal_the_target_alones(client):
    """Completions (logprobs: n) and chat (logprobs, top_logprobs), greedy: the same tokens,
    and logprobs within 1e-3 of K = 0's, for a fixed K, auto K pipelined and the n-gram
    drafter; each text is its tokens' concatenation."""
    for name, speculation in {"alone": {"num_speculative_tokens": 0}, **SPECULATION}.items():
        completion = client.completions.create(
            model="specserve-demo", prompt="def main():\n", max_tokens=24, temperature=0,
            logprobs=5, extra_body=speculation)
        chat = client.chat.completions.create(
            model="specserve-demo", messages=[{"role": "user", "content": "Write a loop."}],
            max_tokens=24, temperature=0, logprobs=True, top_logprobs=2, extra_body=speculation)
        got = completion.choices[0].logprobs
        assert "".join(got.tokens) == completion.choices[0].text
        assert len(got.top_logprobs[0]) == 5 and got.text_offset[0] == 0
        content = chat.choices[0].logprobs.content
        assert all(len(entry.top_logprobs) == 2 for entry in content)
        if name == "alone":
            expected, expected_chat = got, content
            continue
        assert got.tokens == expected.tokens, name
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, expected.token_logprobs)) \
            < 1e-3, name
        assert [e.token for e in content] == [e.token for e in expected_chat], name
        assert max(abs(a.logprob - b.logprob) for a, b in zip(content, expected_chat)) \
            < 1e-3, name


@pytest.mark.parametrize("body", [{"prompt": "x", "logprobs": 21},
                                  {"messages": [{"role": "user", "content": "x"}],
                                   "top_logprobs": 2}])
def test_bad_logprobs_get_400(cluster, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = cluster.post(path, body)
    assert response.status_code == 400, response.text
    assert "logprobs" in response.json()["error"]["param"]
