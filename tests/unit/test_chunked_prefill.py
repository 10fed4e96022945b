"""Chunked prefill: a verifier forward feeds at most max_batch_tokens, shortest feeds first;
a longer feed is cut (its call answers UNFINISHED and goes first into the next batch) and
goes on from its cache, so a long prompt shares forwards with everyone's decodes instead of
stalling them. The answers equal an unchunked verifier's."""

import asyncio

import pytest

from deployments.batcher import ContinuousBatcher
from engine.batch import UNFINISHED
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ScoreCall, prefix_hash
from tests.tiny import hf_greedy, run, tiny_llama
from engine.scheduler import MIN_CHUNK
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0.0)


def verifier(budget: int | None) -> ModelVerifier:
    return ModelVerifier(tiny_llama(1), engine="paged", max_batch_tokens=budget)


def prompt(length: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((offset + 7 * i) % 60 + 1 for i in range(length))


def call(request_id: str, known: tuple[int, ...], new: tuple[int, ...], draft=(3, 4)):
    return ScoreCall(request_id, PrefixSync(len(known), prefix_hash(list(known)), new),
                     draft, GREEDY)


def until_answered(engine: ModelVerifier, pending: ScoreCall) -> tuple[object, int]:
    """(the answer, how many batches it took)."""
    batches, answer = 0, UNFINISHED
    while answer is UNFINISHED:
        assert batches < 100, "a cut feed that never finishes"
        answer, batches = engine.score_batch([pending])[0], batches + 1
    return answer, batches


def test_a_long_prefill_is_cut_beside_a_decode_and_resumed_to_the_same_answer():
    chunked, whole = verifier(32), verifier(None)
    short_prompt = prompt(6, 1)
    for engine in (chunked, whole):
        engine.score_now(call("decode", (), short_prompt))
    decode = call("decode", short_prompt, (9,))
    long = call("long", (), prompt(100))
    cut, decoded = chunked.score_batch([long, decode])
    assert cut is UNFINISHED and decoded.load.batch_tokens == 32  # the decode's 3 + 29 of long
    assert decoded.target_token_ids == whole.score_now(decode).target_token_ids
    answer, batches = until_answered(chunked, long)
    assert batches == 3  # 29 + 32 + 32 fed, then the last 7 + 2 drafts with the logits
    assert answer.target_token_ids == whole.score_now(long).target_token_ids
    # the request goes on as any other: its next round builds on the 100 committed tokens
    following = call("long", prompt(100), (5,))
    assert chunked.score_now(following).target_token_ids == \
        whole.score_now(following).target_token_ids


def test_a_cut_feed_that_builds_on_a_cached_prefix_resumes_without_syncing_twice():
    """A call with known_len > 0 and a long catch-up: re-syncing its new tokens on the
    second batch would be refused as stale; the same call must resume instead."""
    chunked, whole = verifier(MIN_CHUNK), verifier(None)
    head = prompt(10)
    for engine in (chunked, whole):
        engine.score_now(call("r", (), head))
    catch_up = call("r", head, prompt(50, 3))
    answer, batches = until_answered(chunked, catch_up)
    assert batches == 4  # 16 + 16 + 16, then the last 2 + 2 drafts with the logits
    assert answer.target_token_ids == whole.score_now(catch_up).target_token_ids


def test_a_cut_never_reaches_into_the_positions_whose_logits_are_asked_for():
    """K + 1 = 21 positions need logits, more than the 16-token chunk: the cut stops before
    them, the next feed takes them whole (a cut inside them made no progress, forever)."""
    chunked, whole = verifier(MIN_CHUNK), verifier(None)
    long_draft = call("r", (), prompt(30), draft=tuple(range(1, 21)))
    answer, batches = until_answered(chunked, long_draft)
    assert batches == 3  # 16 prompt tokens, then 13 (up to the 21), then the 21 with logits
    assert answer.target_token_ids == whole.score_now(long_draft).target_token_ids


@pytest.mark.parametrize("budget", [8, 32])
def test_greedy_through_a_chunking_verifier_equals_the_target_alone(budget):
    from drafter.model import ModelDrafter

    target = tiny_llama(1)
    reference = hf_greedy(target, list(prompt(70)), 12)
    tokens, _ = run(ModelDrafter(tiny_llama(2)), verifier(budget), prompt(70),
                    SamplingParams(temperature=0.0, max_tokens=12), k=3)
    assert tokens == reference


def test_the_batcher_runs_an_unfinished_call_again_first_in_line():
    runs = []
    cuts = {"long": 2}

    async def run_calls(calls):
        runs.append(list(calls))
        answers = []
        for name in calls:
            if cuts.get(name):
                cuts[name] -= 1
                answers.append(UNFINISHED)
            else:
                answers.append(f"{name} done")
        return answers

    async def main():
        batcher = ContinuousBatcher(run_calls, 2, lambda answer: answer is UNFINISHED)
        return await asyncio.gather(*(batcher.submit(name) for name in ("long", "a", "b")))

    assert asyncio.run(main()) == ["long done", "a done", "b done"]
    assert runs == [["long", "a"], ["long", "b"], ["long"]]
