"""Speculation through the pools over the router's HTTP API is exact, on a real local Ray with
the demo pair: every way of drafting (fixed and adaptive K, rounds of several steps, the
model-free drafters, draft trees), concurrent requests sharing the pools' batches, the prefix
cache and prompts fed in chunks all give the target's own output. The API's surface:
test_http.py."""

import pytest

from speculative.policy import AdaptiveK
from tests.integration.conftest import complete, stream_text

PROMPTS = ["import os\n", "def main():\n", "class Config:\n", "    def __init__(self",
           "for i in range(", "from collections import"]


@pytest.fixture(scope="module")
def alone(cluster):
    """Each prompt's greedy 32 tokens from the target alone (K = 0), asked once for the module's
    tests."""
    def greedy(prompt):
        body = complete(cluster, prompt, max_tokens=32, temperature=0, num_speculative_tokens=0)
        assert body["speculative"]["num_draft_tokens"] == 0
        return body["choices"][0]["text"]

    return {prompt: greedy(prompt) for prompt in PROMPTS}


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_speculation_equals_target_alone(cluster, alone, k):
    for prompt in PROMPTS:
        spec = complete(cluster, prompt, max_tokens=32, temperature=0, num_speculative_tokens=k)
        assert spec["choices"][0]["text"] == alone[prompt], (prompt, k)
        assert spec["speculative"]["num_draft_tokens"] > 0


def test_rounds_of_several_steps_equal_target_alone(cluster):
    """K = 0 rounds that ask the verifier for 4 tokens each (over gRPC, its committed prefix
    then one token behind the router's), and with a stop id among them."""
    for prompt in PROMPTS[:3]:
        alone = complete(cluster, prompt, max_tokens=30, temperature=0, num_speculative_tokens=0,
                         return_token_ids=True)
        steps = complete(cluster, prompt, max_tokens=30, temperature=0, num_speculative_tokens=0,
                         plain_steps=4, return_token_ids=True)
        assert steps["choices"][0]["text"] == alone["choices"][0]["text"], prompt
        assert steps["speculative"]["plain_step_tokens"] > 0
        assert steps["speculative"]["cache_misses"] == 0
        ids = alone["choices"][0]["token_ids"]
        stop = ids[10]
        cut = complete(cluster, prompt, max_tokens=30, temperature=0, num_speculative_tokens=0,
                       plain_steps=4, stop_token_ids=[stop], return_token_ids=True)
        assert cut["choices"][0]["token_ids"] == ids[:ids.index(stop) + 1]
    response = cluster.post("/v1/completions", {"prompt": "x", "plain_steps": 0})
    assert response.status_code == 400 and "plain_steps" in response.text


def test_concurrent_requests_share_the_pools_batches_and_stay_exact(cluster):
    """12 requests at once, of different lengths, speculation on (auto K, fixed K) and off:
    each one's text equals the target alone's, and the pools ran them in shared batches."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(PROMPTS[i % len(PROMPTS)], 12 + 4 * (i % 4), ("auto", 3, 0)[i % 3])
            for i in range(12)]
    alone = {(p, n): complete(cluster, p, max_tokens=n, temperature=0, ignore_eos=True,
                              num_speculative_tokens=0)["choices"][0]["text"]
             for p, n, _ in jobs}
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(
            cluster, job[0], max_tokens=job[1], temperature=0, ignore_eos=True,
            num_speculative_tokens=job[2]), jobs))
    for (prompt, n, k), answer in zip(jobs, answers):
        assert answer["choices"][0]["text"] == alone[(prompt, n)], (prompt, n, k)
    batches = [a["speculative"]["mean_batch_size_verifier"] for a in answers]
    assert max(batches) > 1, batches
    assert any(a["speculative"]["mean_batch_size_drafter"] for a in answers)


@pytest.mark.parametrize("pipelined", [False, True])
def test_adaptive_k_is_exact_and_reports_the_k_it_chose(cluster, alone, pipelined):
    for prompt in PROMPTS[:3]:
        spec = complete(cluster, prompt, max_tokens=32, temperature=0,
                        num_speculative_tokens="auto", pipelined=pipelined)
        assert spec["choices"][0]["text"] == alone[prompt], prompt
        stats = spec["speculative"]
        by_k = {int(k): n for k, n in stats["rounds_by_num_speculative_tokens"].items()}
        # the report adds up: its rounds, and its drafted tokens, by K (and the pre-drafted
        # tokens tested at bonus positions); and it drafted
        assert sum(by_k.values()) == stats["rounds"] and max(by_k) > 0
        assert sum(k * n for k, n in by_k.items()) + stats["bonus_position_drafts"] == \
            stats["num_draft_tokens"]
        # pipelined, it drafted beside its verifies (whether a block was then fully accepted
        # and its pre-draft tested, the K it chose and the acceptance decide)
        assert (stats["predrafts"] > 0) == pipelined, stats
        assert stats["bonus_position_drafts"] <= stats["predrafts"], stats  # a y1 each
        assert stats["mean_num_speculative_tokens"] == pytest.approx(
            stats["num_draft_tokens"] / stats["rounds"])
    response = cluster.post("/v1/completions", {"prompt": "x", "num_speculative_tokens": "many"})
    assert response.status_code == 400 and "num_speculative_tokens" in response.text


def test_the_default_request_drafts(cluster):
    """The router's default (auto K, greedy demo prompts, one at a time) speculates: alone in
    its batches a request drafts at least until its own acceptance is measured (it may turn
    to rounds without a draft after that, where their steps pay more: policy.AdaptiveK)."""
    for prompt in PROMPTS:
        body = complete(cluster, prompt, max_tokens=48, temperature=0, ignore_eos=True)
        stats = body["speculative"]
        # (every position tested was drafted)
        assert stats["num_draft_tokens"] >= AdaptiveK.min_tested, stats


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_the_model_free_drafters_are_exact_too(cluster, drafter):
    prompt = "x = 1\nx = 1\nx = 1\n"
    alone = complete(cluster, prompt, max_tokens=24, temperature=0, num_speculative_tokens=0)
    spec = complete(cluster, prompt, max_tokens=24, temperature=0, drafter=drafter,
                    num_speculative_tokens=4)
    assert spec["choices"][0]["text"] == alone["choices"][0]["text"]
    assert spec["speculative"]["num_draft_tokens"] > 0  # the repeats gave it matches


def test_draft_trees_are_exact_through_the_pools(cluster):
    """Trees cross the wire (parents, per-node q, one forward under an ancestor mask): greedy
    equal to the target alone, streamed equal to plain, with logprobs along the accepted
    path; sampled and seeded, reproducible; a tree with a bad width is a 400."""
    prompt = "def add(a, b):\n"
    alone = complete(cluster, prompt, max_tokens=24, temperature=0, num_speculative_tokens=0,
                     logprobs=2)
    tree = {"width": 3, "depth": 4}
    spec = complete(cluster, prompt, max_tokens=24, temperature=0, speculative_tree=tree,
                    logprobs=2)
    assert spec["choices"][0]["text"] == alone["choices"][0]["text"]
    assert spec["speculative"]["tree_rounds"] > 0
    ours, theirs = spec["choices"][0]["logprobs"], alone["choices"][0]["logprobs"]
    assert ours["tokens"] == theirs["tokens"]
    assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-3)
    text, _ = stream_text(cluster, {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                    "speculative_tree": tree})
    assert text == alone["choices"][0]["text"]
    chosen = complete(cluster, prompt, max_tokens=24, temperature=0, speculative_tree="auto",
                      num_speculative_tokens="auto", pipelined=False)  # chain or tree a round
    assert chosen["choices"][0]["text"] == alone["choices"][0]["text"]
    seeded = [complete(cluster, prompt, max_tokens=16, temperature=1.0, seed=7,
                       speculative_tree={"width": 2})["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]
    bad = cluster.post("/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                          "speculative_tree": {"width": 99}})
    assert bad.status_code == 400 and "width" in bad.text
    bad = cluster.post("/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                          "speculative_tree": "sometimes"})
    assert bad.status_code == 400 and "speculative_tree" in bad.text


def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(cluster):
    """Two prompts sharing a 575-token prefix: the second takes its full blocks from the
    verifier's prefix cache (reported as OpenAI's cached_tokens) and decodes exactly as
    without a hit: the reference is decoded first, before anything is cached (a reference
    decoded after the hit would read the same cached blocks, and share their errors)."""
    prefix = "".join(f"    total += values[{i}] * weights[{i}]\n" for i in range(40))
    alone = complete(cluster, prefix + "    second", max_tokens=8, temperature=0,
                     num_speculative_tokens=0)
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a miss
    first = complete(cluster, prefix + "    first", max_tokens=8, temperature=0,
                     num_speculative_tokens=0)
    assert first["usage"]["prompt_tokens"] >= 575
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 560  # the shared prefix
    second = complete(cluster, prefix + "    second", max_tokens=8, temperature=0,
                      num_speculative_tokens=3)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 560
    uncached = complete(cluster, "#\n" + prefix + "    second", max_tokens=8, temperature=0,
                        num_speculative_tokens=0)  # shifted: no full block in common
    assert uncached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_prompt_longer_than_a_forwards_budget_is_exact_through_both_pools(cluster):
    """A prompt of over 1,024 tokens is fed in chunks of max_batch_tokens (512): by the
    verifier alone first, then by the drafter, whose cut calls answer UNFINISHED and run
    again in its next batches through the pool's batcher; the drafts go on after it, and
    the output is the target's alone."""
    prompt = "".join(f"    total -= values[{i}] * scale[{i}] + {i}\n" for i in range(90))
    alone = complete(cluster, prompt, max_tokens=16, temperature=0, num_speculative_tokens=0)
    assert alone["usage"]["prompt_tokens"] > 1024
    spec = complete(cluster, prompt, max_tokens=16, temperature=0, num_speculative_tokens=4)
    assert spec["choices"][0]["text"] == alone["choices"][0]["text"]
    assert spec["speculative"]["num_draft_tokens"] > 0
