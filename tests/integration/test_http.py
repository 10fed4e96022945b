"""The OpenAI-compatible HTTP API of the router, on a real local Ray with the demo pair.
That speculation through it is exact: test_http_exactness.py."""

import pytest
import requests

from tests.integration.conftest import complete, stream_text


def test_health_and_models(cluster):
    assert requests.get(cluster.base_url + "/health", timeout=10).json() == {"status": "ok"}
    models = requests.get(cluster.base_url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "specserve-demo"
    assert models["data"][0]["max_model_len"] == 2048  # the context, as vLLM's card gives it
    preflight = requests.options(cluster.base_url + "/v1/chat/completions", timeout=10,
                                 headers={"Origin": "https://chat.example",
                                          "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200  # a browser page may call it (vLLM's CORS defaults)
    assert preflight.headers["access-control-allow-origin"] == "*"


def test_tokenize_counts_what_a_request_is_fed_and_detokenize_reverses_it(cluster):
    """vLLM's tokenizer endpoints: a prompt's count is the usage's prompt_tokens of the
    request with the same fields (a completion's and a chat's), and /detokenize gives the
    text back; /version answers."""
    for fields, path in [({"prompt": "import os\n"}, "/v1/completions"),
                         ({"messages": [{"role": "user", "content": "hi"}]},
                          "/v1/chat/completions")]:
        counted = cluster.post("/tokenize", fields)
        assert counted.status_code == 200, counted.text
        served = cluster.post(path, {**fields, "max_tokens": 1}).json()
        assert counted.json()["count"] == served["usage"]["prompt_tokens"]
        assert counted.json()["max_model_len"] == 2048
    ids = cluster.post("/tokenize", {"prompt": "import os\n"}).json()["tokens"]
    assert cluster.post("/detokenize", {"tokens": ids}).json() == {"prompt": "import os\n"}
    assert cluster.post("/detokenize", {"tokens": [-1]}).status_code == 400
    version = requests.get(cluster.base_url + "/version", timeout=10).json()["version"]
    assert version.count(".") == 2


def test_a_begun_reply_is_continued_as_a_completion_of_its_prompt(cluster):
    """continue_final_message: the chat's greedy output is the completion of the prompt
    /tokenize reads for it (its ids, through /v1/completions), speculating both."""
    chat = {"messages": [{"role": "user", "content": "write a loop"},
                         {"role": "assistant", "content": "for i in range("}],
            "add_generation_prompt": False, "continue_final_message": True}
    ids = cluster.post("/tokenize", chat).json()["tokens"]
    reply = cluster.post("/v1/chat/completions", {**chat, "max_tokens": 24, "temperature": 0,
                                                  "ignore_eos": True}).json()
    alone = complete(cluster, ids, max_tokens=24, temperature=0, ignore_eos=True)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == alone["choices"][0]["text"]


@pytest.mark.parametrize("pipelined", [False, None], ids=["sequential", "default"])
def test_response_shape_usage_and_speculative_stats(cluster, pipelined):
    body = complete(cluster, "def ", max_tokens=12, temperature=0, num_speculative_tokens=3,
                    pipelined=pipelined)
    assert body["object"] == "text_completion" and body["model"] == "specserve-demo"
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] == 12 or body["choices"][0]["finish_reason"] == "stop"
    spec = body["speculative"]
    assert set(spec) >= {"rounds", "num_draft_tokens", "num_accepted_tokens",
                         "acceptance_rate", "mean_acceptance_length", "accepted_per_position",
                         "overhead_ms_p50", "wire_bytes_per_round"}
    ms = spec["ms_per_round"]
    assert set(ms) == {"draft", "verify", "transport", "router", "total"}
    # the pools report their own compute; what is left of a round is transport and router.
    # The default pipelines: its drafts run beside the verifies, off the critical path
    assert ms["verify"] > 0 and ms["transport"] > 0
    assert ms["draft"] > 0 if pipelined is False else spec["pipelined_rounds"] > 0
    assert ms["total"] == pytest.approx(ms["draft"] + ms["verify"] + ms["transport"]
                                        + ms["router"], abs=0.01)
    assert 0 < spec["wire_bytes_per_round"] < 1000  # greedy rounds carry token ids only


@pytest.mark.parametrize("body", [
    {"prompt": "def main():\n", "max_tokens": 40, "temperature": 0},
    {"prompt": "import ", "max_tokens": 40, "temperature": 1, "seed": 3},
    {"prompt": "class A:\n", "max_tokens": 40, "temperature": 0, "stop": [":"]},
])
def test_streamed_chunks_concatenate_to_the_non_streamed_text(cluster, body):
    whole = complete(cluster, **body)["choices"][0]["text"]
    streamed, chunks = stream_text(cluster, body)
    assert streamed == whole
    assert len(chunks) > 2


def test_seeded_requests_are_reproducible_and_n_samples_differ(cluster):
    """A seeded request alone repeats its tokens; its n choices differ. Choices share the
    pools' batches in whatever cohorts their calls arrive, and a batch's make-up moves the
    float rounding of its forwards (a drafter step of 1-2 rows takes x @ W, of 3 oneDNN's
    packed weights: docs/engine.md), which can move a draw where q is close to p; so the
    repeat is asserted for a request of one choice, whose batches are its own each time."""
    body = {"prompt": "def ", "max_tokens": 16, "temperature": 1, "seed": 11}
    first, second = (complete(cluster, **body)["choices"][0]["text"] for _ in range(2))
    assert first == second
    assert len({c["text"] for c in complete(cluster, **body, n=3)["choices"]}) > 1


def test_stop_strings_are_not_returned(cluster):
    full = complete(cluster, "def main():\n", max_tokens=30, temperature=0)["choices"][0]["text"]
    stop = full[5:7]
    cut = complete(cluster, "def main():\n", max_tokens=30, temperature=0, stop=stop)
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    kept = complete(cluster, "def main():\n", max_tokens=30, temperature=0, stop=stop,
                    include_stop_str_in_output=True, stream=False)
    assert kept["choices"][0]["text"] == full[: full.index(stop) + len(stop)]


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "num_speculative_tokens": -1}, 400, "num_speculative_tokens"),
    ({"prompt": "x", "drafter": "tree"}, 400, "drafter"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-5"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(cluster, body, status, param):
    response = cluster.post("/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and error["message"] and error["type"]


def test_invalid_json_is_a_400(cluster):
    response = requests.post(cluster.base_url + "/v1/completions", data=b"{not json",
                             headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_chat_through_the_openai_client_plain_and_streaming(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Parse a config file."}]
    plain = client.chat.completions.create(model="specserve-demo", messages=messages,
                                           max_tokens=24, temperature=0)
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model="specserve-demo", messages=messages,
                                                 max_tokens=24, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"  # as OpenAI's first chunk
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        plain.choices[0].finish_reason


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(cluster):
    """Not capped at the completions default of 16: a prompt that leaves 40 tokens of the
    demo target's 2048 gets up to 40; a max_tokens past that room is cut to it (vLLM 0.32's
    get_max_tokens), one past the context itself is a 400."""
    from engine.models import DEMO_TARGET, load_tokenizer

    tokenizer = load_tokenizer(DEMO_TARGET)

    def prompt_tokens(repeats: int) -> int:
        messages = [{"role": "user", "content": "x = 1\n" * repeats}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    per_repeat = (prompt_tokens(400) - prompt_tokens(200)) / 200
    content = "x = 1\n" * int(400 + (2048 - 40 - prompt_tokens(400)) / per_repeat)
    body = cluster.post("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": content}],
                                                 "temperature": 0, "ignore_eos": True}).json()
    left = 2048 - body["usage"]["prompt_tokens"]
    assert 16 < left <= 48 and body["usage"]["completion_tokens"] == left
    asked = {"messages": [{"role": "user", "content": content}], "temperature": 0,
             "ignore_eos": True, "max_tokens": 2048}
    cut = cluster.post("/v1/chat/completions", asked).json()
    assert cut["usage"]["completion_tokens"] == left and \
        cut["choices"][0]["finish_reason"] == "length"
    refused = cluster.post("/v1/chat/completions", {**asked, "max_tokens": 2049})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_the_openai_client_works_plain_and_streaming(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    plain = client.completions.create(model="specserve-demo", prompt="def main():\n",
                                      max_tokens=20, temperature=0)
    stream = client.completions.create(model="specserve-demo", prompt="def main():\n",
                                       max_tokens=20, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert plain.choices[0].text == streamed and plain.usage.completion_tokens > 0
    assert [m.id for m in client.models.list().data] == ["specserve-demo"]


def test_ignore_eos_decodes_past_the_end_of_text(cluster):
    prompt = 'if __name__ == "__main__":\n    main()\n'  # the demo target ends the file here
    ended = complete(cluster, prompt, max_tokens=8, temperature=0)
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["usage"]["completion_tokens"] == 1  # the EOS token itself
    forced = complete(cluster, prompt, max_tokens=8, temperature=0, ignore_eos=True)
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 8


def test_prompt_logprobs_and_echo_are_the_targets_own(cluster):
    """vLLM's prompt_logprobs through the verifier pool (its PromptLogprobs rpc, through
    Serve's proxy): a prompt's last token, the greedy output of the prompt before it, is
    ranked 1 at the logprob its verify call gave it; the openai client's echo with logprobs
    (as lm-evaluation-harness asks it) carries the same values before the output's."""
    import openai

    first = complete(cluster, "def main():\n", max_tokens=1, temperature=0, logprobs=0,
                     return_token_ids=True)["choices"][0]
    ids = first["prompt_token_ids"] + first["token_ids"]
    second = complete(cluster, ids, max_tokens=2, temperature=0, prompt_logprobs=2,
                      ignore_eos=True)
    rows = second["choices"][0]["prompt_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    assert all(str(token) in row for token, row in zip(ids[1:], rows[1:]))
    last = rows[-1][str(ids[-1])]
    assert last["rank"] == 1
    assert last["logprob"] == pytest.approx(first["logprobs"]["token_logprobs"][0], abs=1e-3)
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    echoed = client.completions.create(model="specserve-demo", prompt=ids, max_tokens=2,
                                       temperature=0, echo=True, logprobs=1,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == cluster.post("/detokenize", {"tokens": ids}).json()["prompt"] + \
        second["choices"][0]["text"]
    token_logprobs = echoed.logprobs.token_logprobs
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids) + 2
    assert token_logprobs[1:len(ids)] == pytest.approx(
        [row[str(token)]["logprob"] for token, row in zip(ids[1:], rows[1:])], abs=1e-6)
    streamed = cluster.post("/v1/completions", {"prompt": ids, "prompt_logprobs": 1,
                                                "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


def test_the_responses_api_answers_as_the_chat_it_translates_to(cluster):
    """OpenAI's Responses API through the official client on the shared deployment: the
    greedy output text is the chat's for the same message, whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="specserve-demo", messages=[{"role": "user", "content": "write a loop"}],
        max_tokens=12, temperature=0).choices[0].message.content
    whole = client.responses.create(model="specserve-demo", input="write a loop",
                                    max_output_tokens=12, temperature=0)
    assert whole.output_text == chat and whole.status in ("completed", "incomplete")
    events = list(client.responses.create(model="specserve-demo", input="write a loop",
                                          max_output_tokens=12, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat
    assert events[-1].response.output_text == chat
