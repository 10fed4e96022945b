"""Chunked prefill: a verifier forward feeds at most max_batch_tokens, shortest feeds first;
a longer feed is cut (its call answers UNFINISHED and goes first into the next batch) and
goes on from its cache, so a long prompt shares forwards with everyone's decodes instead of
stalling them. The answers equal an unchunked verifier's."""

import asyncio

import pytest

from deployments.batcher import ContinuousBatcher
from engine.batch import UNFINISHED
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ScoreCall
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


def until_answered(engine, pending) -> tuple[object, int]:
    """(the answer of a verifier's or a drafter's engine, how many batches it took)."""
    batch = engine.score_batch if isinstance(engine, ModelVerifier) else engine.propose_batch
    batches, answer = 0, UNFINISHED
    while answer is UNFINISHED:
        assert batches < 100, "a cut feed that never finishes"
        answer, batches = batch([pending])[0], batches + 1
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


def drafter(budget: int | None):
    from drafter.model import ModelDrafter

    return ModelDrafter(tiny_llama(2), engine="paged", max_batch_tokens=budget)


def propose(request_id: str, known: tuple[int, ...], new: tuple[int, ...], k: int = 3,
            sampling: SamplingParams = GREEDY, assumed: tuple[int, ...] = ()):
    from speculative.types import ProposeCall

    return ProposeCall(request_id, PrefixSync(len(known), prefix_hash(list(known)), new), k,
                       sampling, 5, assumed)


@pytest.mark.parametrize("k", [0, 3])
def test_the_drafter_cuts_a_long_feed_beside_a_draft_and_resumes_to_the_same_block(k):
    """The drafter's batches are bounded as the verifier's: a long prompt's first call (its
    prefill beside the target's first verify, k = 0, or a draft) is fed in chunks, and a
    short request's draft runs in the first batch instead of waiting for the whole
    prefill."""
    chunked, whole = drafter(32), drafter(None)
    short_prompt = prompt(6, 1)
    for engine in (chunked, whole):
        engine.propose_now(propose("short", (), short_prompt))
    drafting = propose("short", short_prompt, (9,))
    long = propose("long", (), prompt(100), k)
    cut, drafted = chunked.propose_batch([long, drafting])
    assert cut is UNFINISHED and drafted.load.batch_tokens == 1  # the new token, fed...
    assert len(chunked.sessions.get("long").cached_ids) == 31  # ...beside 31 of long's
    assert drafted.token_ids == whole.propose_now(drafting).token_ids
    answer, batches = until_answered(chunked, long)
    assert batches == 3  # 32 + 32 more fed, then the last 5 (with the draft's logits)
    assert answer.token_ids == whole.propose_now(long).token_ids and len(answer.token_ids) == k
    following = propose("long", prompt(100), (5,), 3, assumed=(7, 8))
    assert chunked.propose_now(following).token_ids == whole.propose_now(following).token_ids


def test_a_sampled_draft_after_a_chunked_feed_draws_the_same_block_and_q():
    """Seeded: the same tokens, and q equal to float32 rounding (the chunks' forwards sum
    in another order)."""
    import torch

    sampled = SamplingParams(temperature=1.0)
    chunked, whole = drafter(MIN_CHUNK), drafter(None)
    long = propose("r", (), prompt(60, 2), 4, sampled)
    answer, batches = until_answered(chunked, long)
    assert batches == 4  # 16 + 16 + 16, then the last 12 with the draft
    expected = whole.propose_now(long)
    assert answer.token_ids == expected.token_ids
    torch.testing.assert_close(answer.draft_probs.dense("cpu"),
                               expected.draft_probs.dense("cpu"))


@pytest.mark.parametrize("budget", [MIN_CHUNK, 32])
def test_greedy_through_a_chunking_drafter_equals_the_target_alone(budget):
    target = tiny_llama(1)
    reference = hf_greedy(target, list(prompt(70)), 12)
    for pipelined in (False, True):
        tokens, state = run(drafter(budget), verifier(None), prompt(70),
                            SamplingParams(temperature=0.0, max_tokens=12), k=3,
                            pipelined=pipelined)
        assert tokens == reference and state.stats.num_draft_tokens > 0


@pytest.mark.parametrize("pool", ["verifier", "drafter"])
def test_a_cut_feed_that_builds_on_a_cached_prefix_resumes_without_syncing_twice(pool):
    """A call with known_len > 0 and a long catch-up: re-syncing its new tokens on the
    second batch would be refused as stale; the same call must resume instead."""
    make, first = (verifier, call) if pool == "verifier" else (drafter, propose)
    chunked, whole = make(MIN_CHUNK), make(None)
    head = prompt(10)
    for engine in (chunked, whole):
        until_answered(engine, first("r", (), head))
    catch_up = first("r", head, prompt(50, 3))
    answer, batches = until_answered(chunked, catch_up)
    assert batches == 4  # 16 + 16 + 16, then the last 2 (+ 2 drafts) with the logits
    assert tokens_of(answer) == tokens_of(until_answered(whole, catch_up)[0])


def tokens_of(answer) -> tuple[int, ...]:
    """A verifier's answer's target tokens, a drafter's drafted ones."""
    return tuple(getattr(answer, "target_token_ids", None) or answer.token_ids)


@pytest.mark.parametrize("pool", ["verifier", "drafter"])
def test_a_cut_feed_that_cannot_have_its_whole_feed_is_refused_before_its_first_chunk(pool):
    """A paged pool of 13 usable blocks (208 positions), a batch-mate holding 7 (100
    positions, in the batch: not evictable), and a 100-token prompt cut into 16-token
    chunks: it is refused at once, with no chunk computed. Reserved chunk by chunk, it was
    admitted, fed chunks, and was refused at a later one, its chunks lost with its
    session."""
    from drafter.model import ModelDrafter
    from engine.cache import KVCacheFull

    def make():
        if pool == "verifier":
            return ModelVerifier(tiny_llama(1), engine="paged", kv_cache_tokens=208,
                                 max_batch_tokens=MIN_CHUNK)
        return ModelDrafter(tiny_llama(2), engine="paged", kv_cache_tokens=208,
                            max_batch_tokens=MIN_CHUNK)

    def one(request_id, known, new):  # a call of one drafted token, or drafting one
        return call(request_id, known, new, draft=(3,)) if pool == "verifier" else \
            propose(request_id, known, new, k=1)

    engine = make()
    batch = engine.score_batch if pool == "verifier" else engine.propose_batch
    held = prompt(99, 2)
    until_answered(engine, one("held", (), held))
    free = engine.runner.pool.free_units
    long = one("long", (), prompt(100))
    forwards = []
    forward = engine.runner.forward
    engine.runner.forward = lambda segments: forwards.append(len(segments)) or \
        forward(segments)
    decoded, refused = batch([one("held", held, (5,)), long])
    assert isinstance(refused, KVCacheFull)  # at its first chunk...
    assert not isinstance(decoded, Exception) and forwards == [1]  # ...only held's fed
    assert engine.runner.pool.free_units <= free  # and nothing kept for the long one
