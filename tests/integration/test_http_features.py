"""What OpenAI clients send beyond a prompt, over HTTP through the official openai client,
exact under speculation: penalties."""

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
