"""What OpenAI clients send beyond a prompt, over HTTP through the official openai client,
exact under speculation: penalties, logit_bias, min_tokens, n, logprobs, structured outputs
and tool calls."""

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


@pytest.fixture(scope="module")
def unpenalised(client) -> dict[str, str]:
    """Each prompt's greedy text from the target alone without a penalty (asked once)."""
    return {prompt: complete(client, prompt, {}, {"num_speculative_tokens": 0}).choices[0].text
            for prompt in PROMPTS}


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalised_greedy_equals_the_target_alone_and_differs_from_unpenalised(
        client, unpenalised, penalty):
    changed = 0
    for prompt in PROMPTS:
        alone = complete(client, prompt, PENALTIES[penalty], {"num_speculative_tokens": 0})
        for name, speculation in SPECULATION.items():
            spec = complete(client, prompt, PENALTIES[penalty], speculation)
            assert spec.choices[0].text == alone.choices[0].text, (prompt, penalty, name)
        changed += unpenalised[prompt] != alone.choices[0].text
    assert changed > 0, "the penalty changed no output"


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5),
                                          ("frequency_penalty", -2.1),
                                          ("repetition_penalty", 0)])
def test_out_of_range_penalties_get_400(cluster, field, value):
    response = cluster.post("/v1/completions", {"prompt": "x", field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field)


def test_logit_bias_and_min_tokens_hold_and_equal_the_target_alone(client):
    """The plain greedy output's most common token banned (-100) and its first token a stop
    id held back by min_tokens (ignore_eos off): neither shows where it may not, and the
    output equals K = 0's with each speculation setting."""
    plain = client.completions.create(model="specserve-demo", prompt=PROMPTS[0], max_tokens=24,
                                      temperature=0, extra_body={"return_token_ids": True,
                                                                 "num_speculative_tokens": 0})
    ids = plain.choices[0].token_ids
    banned = max(set(ids), key=ids.count)
    held = next(t for t in ids if t != banned)
    shaping = {"logit_bias": {str(banned): -100}, "extra_body": {
        "min_tokens": 12, "stop_token_ids": [held], "return_token_ids": True}}
    alone = complete(client, PROMPTS[0], shaping, {"num_speculative_tokens": 0}).choices[0]
    assert banned not in alone.token_ids and held not in alone.token_ids[:12]
    assert len(alone.token_ids) >= 12 and alone.token_ids != ids[:len(alone.token_ids)]
    for name, speculation in SPECULATION.items():
        spec = complete(client, PROMPTS[0], shaping, speculation).choices[0]
        assert spec.token_ids == alone.token_ids, name


def test_a_hundred_choices_and_vllms_speculative_metrics(client):
    """n = 100 in one request (OpenAI's bound is 128), each choice sampled; the response
    carries vLLM's per-request speculative metrics beside the speculative block."""
    response = client.completions.create(model="specserve-demo", prompt=PROMPTS[1],
                                         max_tokens=8, temperature=1.0, n=100, seed=3,
                                         extra_body={"num_speculative_tokens": 3})
    assert sorted(c.index for c in response.choices) == list(range(100))
    assert len({c.text for c in response.choices}) > 10
    metrics = response.model_extra["metrics"]["speculative_decoding"]
    stats = response.model_extra["speculative"]
    assert metrics["num_draft_tokens"] == stats["num_draft_tokens"] > 0
    assert sum(metrics["acceptance_histogram"]) == metrics["num_spec_steps"] > 0
    assert metrics["num_accepted_draft_tokens"] == stats["num_accepted_tokens"]


def test_a_batch_of_prompts_answers_each_with_its_n_choices(client):
    """prompt as a list (text and token ids), as OpenAI's and vLLM's completions take it:
    choice i * n + j is prompt i's j-th, each prompt's greedy text as alone; usage counts
    each prompt once; streamed, the same choices."""
    from engine.models import DEMO_TARGET, load_tokenizer

    tokenizer = load_tokenizer(DEMO_TARGET)
    fields = dict(model="specserve-demo", max_tokens=12, temperature=0, n=2)
    alone = [client.completions.create(prompt=p, **fields) for p in PROMPTS[:2]]
    texts = [c.text for a in alone for c in a.choices]
    batch = client.completions.create(prompt=PROMPTS[:2], **fields)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == texts
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]
    assert [c.text for c in client.completions.create(prompt=ids, **fields).choices] == texts
    streamed = {}
    for chunk in client.completions.create(prompt=PROMPTS[:2], stream=True, **fields):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == texts


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"3": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"min_tokens": 20, "max_tokens": 8},
                                                      "min_tokens"),
    ({"n": 129}, "n")])
def test_bad_bias_min_tokens_and_n_get_400(cluster, body, param):
    response = cluster.post("/v1/completions", {"prompt": "x", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param), response.text


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


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}
REGEX = r"def [a-z_]{1,12}\(self\):"
CHOICES = ["import os", "import sys", "from typing import List"]
CONSTRAINED = {
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "item", "schema": SCHEMA}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
    "choice": {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
    # llama.cpp's GBNF of REGEX's language (converted to Lark by the router; the pools
    # compile the Lark)
    "gbnf": {"extra_body": {"structured_outputs": {
        "grammar": 'root ::= "def " [a-z_]{1,12} "(self):"'}}},
}


def follows(name: str, text: str) -> bool:
    import json
    import re

    import jsonschema

    if name.startswith("json"):
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA if name == "json_schema" else {"type": "object"})
        return True
    if name in ("regex", "gbnf"):
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def constrained_chat(client, name: str, speculation: dict, **fields):
    request = dict(CONSTRAINED[name])
    extra = {**request.pop("extra_body", {}), **speculation}
    return client.chat.completions.create(
        model="specserve-demo", messages=[{"role": "user", "content": "One item, please."}],
        max_tokens=64, extra_body=extra, **request, **fields)


@pytest.mark.parametrize("name", list(CONSTRAINED))
def test_constrained_greedy_follows_its_constraint_and_equals_the_target_alone(client, name):
    """(Any JSON object may run past max_tokens: the demo target writes one long key, and
    the output ends with finish_reason "length", as OpenAI's does.)"""
    alone = constrained_chat(client, name, {"num_speculative_tokens": 0}, temperature=0)
    text = alone.choices[0].message.content
    if name != "json_object":
        assert alone.choices[0].finish_reason == "stop" and follows(name, text), text
    elif alone.choices[0].finish_reason == "stop":
        assert follows(name, text), text
    else:  # cut at max_tokens: at least an object begun (the demo target writes code)
        assert alone.choices[0].finish_reason == "length" and text.lstrip().startswith("{"), text
    for label, speculation in SPECULATION.items():
        spec = constrained_chat(client, name, speculation, temperature=0)
        assert spec.choices[0].message.content == text, (name, label)


def test_a_structural_tag_fires_and_holds_exactly_under_speculation(client):
    """vLLM's structural tag through the pools: free text until `return (`, then a JSON
    string and ")"; every speculation setting's greedy text equals K = 0's."""
    import re

    tag = {"type": "structural_tag", "triggers": ["return ("], "structures": [
        {"begin": "return (", "schema": {"type": "string", "maxLength": 12}, "end": ")"}]}

    def complete(speculation: dict) -> str:
        return client.completions.create(
            model="specserve-demo", prompt="raise ValueError(", max_tokens=40, temperature=0,
            extra_body={"response_format": tag, **speculation}).choices[0].text

    text = complete({"num_speculative_tokens": 0})
    opened = [m.end() for m in re.finditer(re.escape("return ("), text)]
    assert opened and all(re.match(r'"[^"]{0,12}"\)', text[at:]) for at in opened), text
    for label, speculation in SPECULATION.items():
        assert complete(speculation) == text, label


def test_beam_search_answers_its_beams_and_a_width_of_one_is_greedy(client):
    """vLLM's use_beam_search through the deployment: n beams, distinct, each max_tokens
    long under ignore_eos; one beam is the greedy output (each step's likeliest token)."""
    def beams(n: int):
        return client.completions.create(
            model="specserve-demo", prompt=PROMPTS[0], max_tokens=12, n=n, temperature=0,
            extra_body={"use_beam_search": True, "ignore_eos": True,
                        "return_token_ids": True}).choices

    greedy = client.completions.create(model="specserve-demo", prompt=PROMPTS[0],
                                       max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "num_speculative_tokens": 0})
    assert beams(1)[0].token_ids == greedy.choices[0].token_ids
    three = beams(3)
    assert len({tuple(c.token_ids) for c in three}) == 3
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in three)


@pytest.mark.slow
def test_sampled_output_under_a_regex_matches_the_target_alones(cluster):
    """Two samples at T = 1, speculative (K = 3) and the target alone, of the output under
    a regex whose words span several tokens: one law (two-sample chi-square at a
    false-failure rate of 1e-6, 20 seeded requests of n = 16 each)."""
    from tests.stats.chisq import two_sample_chi_square

    samples = []
    for k, seed in ((0, 0), (3, 10_000)):
        bodies = [{"prompt": "# pick one\n", "max_tokens": 16, "temperature": 1.0, "n": 16,
                   "seed": seed + i, "num_speculative_tokens": k,
                   "structured_outputs": {"regex": "(import|from) (os|sys|json|typing)"}}
                  for i in range(20)]
        counts: dict[str, int] = {}
        for response in cluster.post_many("/v1/completions", bodies):
            assert response.status_code == 200, response.text
            for choice in response.json()["choices"]:
                counts[choice["text"]] = counts.get(choice["text"], 0) + 1
        samples.append(counts)
    statistic, threshold, df = two_sample_chi_square(*samples, 1e-6)
    assert len(samples[0]) > 1 and statistic < threshold, (samples, statistic, threshold, df)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_constraints_that_cannot_compile_get_400_naming_the_field(cluster, body, field):
    response = cluster.post("/v1/completions", {"prompt": "x", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_streamed_logprobs_arrive_with_their_chunks(client):
    """As OpenAI and vLLM stream them: each chunk carries its tokens' logprobs, and together
    they are the plain response's."""
    fields = dict(model="specserve-demo", prompt="import os\n", max_tokens=16, temperature=0,
                  logprobs=2)
    plain = client.completions.create(**fields).choices[0].logprobs
    chunks = [chunk.choices[0] for chunk in client.completions.create(stream=True, **fields)
              if chunk.choices and chunk.choices[0].logprobs is not None]
    assert len(chunks) > 1
    assert [t for c in chunks for t in c.logprobs.tokens] == plain.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == plain.text_offset
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == \
        pytest.approx(plain.token_logprobs, abs=1e-3)


FORECAST = {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def streamed_chat(client, **fields) -> tuple[str | None, list[dict], str]:
    """(content, tool_calls, finish_reason) accumulated from a stream's deltas."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for call in choice.delta.tool_calls or ():
            got = calls.setdefault(call.index, {"name": "", "arguments": ""})
            got["name"] += call.function.name or ""
            got["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_required_tool_call_follows_its_schema_exactly_under_speculation(client):
    """tool_choice "required", greedy: one call whose arguments validate against the
    function's schema; the same call at K = 0, 4 and auto, and streamed."""
    import json

    import jsonschema

    fields = dict(model="specserve-demo", messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=64, temperature=0)
    calls = {}
    for k in (0, 4, "auto"):
        choice = client.chat.completions.create(
            **fields, extra_body={"num_speculative_tokens": k}).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, k
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), FORECAST)
        calls[k] = {"name": call.function.name, "arguments": call.function.arguments}
    assert calls[4] == calls[0] and calls["auto"] == calls[0], calls
    content, streamed, finish = streamed_chat(client, **fields,
                                              extra_body={"num_speculative_tokens": 4})
    assert (content, streamed, finish) == (None, [calls[0]], "tool_calls")


def test_a_tool_result_round_trips(client):
    """The call goes back as the assistant's tool_calls with a role "tool" result; the
    model answers (tools offered: auto, streamed equal to whole), and tool_choice "none"
    answers as if no tools were offered."""
    call = {"id": "call_0", "type": "function", "function": {
        "name": "get_forecast", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "12 C, light rain"}]
    fields = dict(model="specserve-demo", messages=messages, max_tokens=16, temperature=0)
    auto = client.chat.completions.create(tools=TOOLS, **fields).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    assert auto.message.content or auto.message.tool_calls
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in auto.message.tool_calls or ()]
    assert streamed_chat(client, tools=TOOLS, **fields) == \
        (auto.message.content or None, calls, auto.finish_reason)
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **fields)
    plain = client.chat.completions.create(**fields)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_get_400_naming_the_field(client, fields, param):
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="specserve-demo", messages=ASK, max_tokens=4,
                                       **fields)
    assert refused.value.param == param
