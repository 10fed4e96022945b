"""OpenAI's Predicted Outputs through the official openai client on the shared deployment: a
chat (and, an extension, a completion) with a prediction answers as without one (greedy,
K = 0, 4 and auto, streamed too), its drafts taken from the prediction, and its usage counts
the prediction's tokens."""

import pytest

MESSAGES = [{"role": "user", "content": "Parse a config file."}]


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")


def chat(client, k, **fields):
    return client.chat.completions.create(
        model="specserve-demo", messages=MESSAGES, max_tokens=48, temperature=0,
        extra_body={"num_speculative_tokens": k}, **fields)


def test_a_prediction_drafts_the_answer_and_leaves_it_the_models_own(client):
    alone = chat(client, 0)
    text = alone.choices[0].message.content
    edited = text.replace("\n", "\n# edited\n", 2)  # a prediction partly wrong
    for prediction in (text, edited):
        asked = {"type": "content", "content": prediction}
        for k in (0, 4, "auto"):
            answer = chat(client, k, prediction=asked)
            assert answer.choices[0].message.content == text, (k, prediction)
            details = answer.usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 0, k
            if prediction is text and k == 4:  # every proposal from the answer's own text
                stats = answer.model_extra["speculative"]
                assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0
        chunks = list(chat(client, "auto", prediction=asked, stream=True,
                           stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_a_prediction_of_another_shape_is_a_400_naming_it(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        chat(client, 0, prediction={"type": "text", "content": "x"})
    assert refused.value.body["param"] == "prediction"


def test_a_completion_takes_a_prediction_too(client):
    """An extension (OpenAI's and vLLM's completions have none): the same answer, drafted
    from the prediction and counted against it."""
    ask = {"model": "specserve-demo", "prompt": "def parse(self", "max_tokens": 32,
           "temperature": 0}
    text = client.completions.create(**ask, extra_body={"num_speculative_tokens": 0}
                                     ).choices[0].text
    answer = client.completions.create(**ask, extra_body={
        "num_speculative_tokens": 4, "prediction": {"type": "content", "content": text}})
    assert answer.choices[0].text == text
    assert answer.usage.completion_tokens_details.accepted_prediction_tokens > 0
