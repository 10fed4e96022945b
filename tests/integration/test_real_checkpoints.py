"""The router on a pair with real checkpoints' properties (tests/conftest.py quirky_pair_dir:
three end tokens, padded vocabularies, sliding windows) and the CLI against the router: the
same request gives the same text, ids, finish reason and usage through both front ends."""

import json

import pytest

from specserve.cli import main
from engine.models import DEMO_TARGET, load_tokenizer
from tests.conftest import QUIRKY_PROMPT


def post(cluster, path, body):
    response = cluster.post(path, body)
    assert response.status_code == 200, response.text
    return response.json()


def cli(capsys, target, draft, prompt, *flags):
    code = main(["generate", "--target", target, "--draft", draft, "--json", "--prompt", prompt,
                 *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.mark.slow
def test_the_router_stops_at_any_end_token_and_decodes_past_windows_and_padding(cluster, quirky):
    report = json.loads((quirky / "report.json").read_text())
    body = {"model": "quirky", "prompt": QUIRKY_PROMPT, "max_tokens": 40, "temperature": 0,
            "return_token_ids": True}
    for k in (0, 4):
        forced = post(cluster, "/quirky/v1/completions",
                      {**body, "ignore_eos": True, "num_speculative_tokens": k})
        assert forced["choices"][0]["token_ids"] == report["greedy"]
    ended = post(cluster, "/quirky/v1/completions", body)["choices"][0]
    end_at = report["end_at"]
    assert ended["token_ids"] == report["greedy"][: end_at + 1]
    assert (ended["finish_reason"], ended["stop_reason"]) == ("stop", None)  # as vLLM
    sampled = post(cluster, "/quirky/v1/completions",
                   {**body, "temperature": 1, "seed": 5, "ignore_eos": True, "drafter": "ngram"})
    assert len(sampled["choices"][0]["token_ids"]) == 40  # the n-gram q spans 320 ids


@pytest.mark.slow
@pytest.mark.parametrize("fields, flags", [
    ({"temperature": 0}, ["--temperature", "0"]),
    ({"temperature": 0, "stop": ["):"]}, ["--temperature", "0", "--stop", "):"]),
    ({"temperature": 1, "seed": 7, "n": 2}, ["--temperature", "1", "--seed", "7", "--n", "2"]),
])
def test_the_cli_and_the_router_return_the_same_request(cluster, capsys, fields, flags):
    """Same ids, text, finish reason and usage (the CLI's default draft q is the router
    config's, whole in float16, and both pipeline: then even the sampled draws are the
    same)."""
    from engine.models import DEMO_DRAFT

    prompt = "def parse(self, text"
    http = post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 40,
                                              "return_token_ids": True, "pipelined": True,
                                              **fields})
    local = cli(capsys, DEMO_TARGET, DEMO_DRAFT, prompt, "--max-tokens", "40", "-k", "4",
                "--pipelined", *flags)
    tokenizer = load_tokenizer(DEMO_TARGET)
    for ours, theirs in zip(local["choices"], http["choices"], strict=True):
        for key in ("token_ids", "text", "finish_reason", "stop_reason"):
            assert ours[key] == theirs[key], key
        if theirs["finish_reason"] == "length":  # no stop string cut the text
            assert theirs["text"] == tokenizer.decode(theirs["token_ids"],
                                                      skip_special_tokens=True)
    assert local["usage"] == http["usage"]
