"""KV caches: rollback is invisible, a miss rebuilds exactly, the LRU bound holds."""

import asyncio
import random

import pytest
import torch

from drafter.model import ModelDrafter
from engine.kv import STALE_S, SessionStore, common_prefix_len
from engine.runner import serving_runner
from speculative.fixed_k import FixedK
from speculative.loop import run_rounds
from speculative.prefixes import GrowingPrefixHash, prefix_hash
from speculative.state import Request, RequestState
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, StaleBase
from tests.tiny import hf_greedy, run, tiny_llama
from verifier.engine import ModelVerifier

# fp32 logits of the same tokens through a cropped-and-refed cache vs a fresh forward differ
# by float reassociation only (~1e-6 measured); 1e-4 leaves room and still catches a stale
# key/value, which moves logits by O(1).
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_llama(1)


def served(model):
    """transformers' modeling over the model, as a runner (a DynamicCache per request)."""
    return serving_runner(model, "transformers")


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def sync(known, new):
    return PrefixSync(len(known), prefix_hash(known), tuple(new))


def test_logits_after_rollback_and_refeed_equal_a_fresh_forward(model):
    store = SessionStore(4)
    prompt = [3, 14, 15, 9, 26]
    seq = store.apply("r", sync([], prompt))
    seq.feed(served(model), [7, 7, 7, 7], num_logits=5)  # a drafted block, later rejected
    seq = store.apply("r", sync(prompt, [7, 40]))  # committed: 1 accepted + 1 recovered
    logits = seq.feed(served(model), [1, 2, 3], num_logits=4)
    expected = full_logits(model, prompt + [7, 40, 1, 2, 3])[-4:]
    assert seq.cache.get_seq_length() == len(prompt) + 5 == len(seq.cached_ids)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_a_k_token_verify_equals_one_token_decodes(model):
    store = SessionStore(4)
    prompt, drafted = [5, 6, 7], [8, 9, 10, 11]
    seq = store.apply("r", sync([], prompt))
    block = seq.feed(served(model), drafted, num_logits=5)
    stepwise = [full_logits(model, prompt + drafted[:i])[-1] for i in range(5)]
    torch.testing.assert_close(block, torch.stack(stepwise), atol=ATOL, rtol=0)


def test_a_call_whose_base_is_not_here_is_refused_without_changing_state(model):
    store = SessionStore(4)
    with pytest.raises(StaleBase):
        store.apply("unknown", sync([1, 2], [3]))
    store.apply("r", sync([], [1, 2, 3]))
    with pytest.raises(StaleBase):
        store.apply("r", sync([1, 2, 9], [4]))  # right length, wrong tokens
    with pytest.raises(StaleBase):
        store.apply("r", sync([1, 2], [3]))  # an older base
    assert store.apply("r", sync([1, 2, 3], [4])).committed == [1, 2, 3, 4]
    assert store.stats.misses == 3


def test_the_growing_fingerprint_equals_hashing_the_whole_prefix():
    """What the router and the pools compute per call, fed only the tokens added, equals the
    fingerprint of the whole prefix as it grows (by rounds of 0-5 tokens), and after a cut
    (a stop string) and a rebuild's restart."""
    rng = random.Random(7)
    hasher, ids = GrowingPrefixHash(), []
    for _ in range(200):
        ids.extend(rng.randrange(50_000) for _ in range(rng.randrange(6)))
        assert hasher.of(ids) == prefix_hash(ids)
    del ids[-7:]
    assert hasher.of(ids) == prefix_hash(ids)
    ids.append(3)
    assert hasher.of(ids) == prefix_hash(ids)
    assert hasher.of([]) == prefix_hash([])
    assert hasher.of([9, 8]) == prefix_hash([9, 8]) != prefix_hash([8, 9])


def test_the_growing_fingerprint_of_a_prefix_read_in_place_equals_its_slices():
    """of(ids, length) (a call of several steps confirms the prefix but its last token, read
    in place, not sliced) equals the fingerprint of ids[:length] as the list grows, its
    prefix passed shorter, whole, or beyond its end."""
    rng = random.Random(5)
    hasher, ids = GrowingPrefixHash(), []
    for _ in range(300):
        ids.extend(rng.randrange(50_000) for _ in range(rng.randrange(6)))
        length = rng.choice((len(ids), max(0, len(ids) - 1), len(ids) + 2,
                             rng.randrange(len(ids) + 1)))
        assert hasher.of(ids, length) == prefix_hash(ids[:length])
        assert hasher.of(ids) == prefix_hash(ids)


def test_the_common_prefix_is_the_first_difference_wherever_it_lies():
    """A cached sequence against the next feed: the length of their common prefix whether
    they differ at the start, in the middle, in the last few ids (rejected drafts), not at
    all, or one is a prefix of the other, in either order; checked against a scan."""
    def scanned(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    rng = random.Random(11)
    for _ in range(3000):
        a = [rng.randrange(4) for _ in range(rng.choice((0, 1, 7, 60, 700)))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(9))]
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == scanned(a, b)
    ids = list(range(1000))
    for at in (0, 1, 7, 8, 9, 63, 64, 65, 500, 991, 992, 999):
        other = ids[:at] + [-1] + ids[at + 1:]
        assert common_prefix_len(ids, other) == at


def test_the_lru_bound_holds_and_evicts_the_least_recently_used():
    store = SessionStore(3)
    for name in "abcd":
        store.apply(name, sync([], [1]))
    store.apply("b", sync([1], [2]))  # touch b
    store.apply("e", sync([], [1]))
    assert len(store) == 3 and store.stats.evictions == 2
    assert "a" not in store and "c" not in store and "b" in store
    with pytest.raises(StaleBase):
        store.apply("a", sync([1], [2]))


class MovingPool:
    """Routes each call to a random replica, as a rescaled or failed-over pool would."""

    def __init__(self, replicas, seed):
        self.replicas, self.rng = replicas, random.Random(seed)

    async def propose(self, call):
        return await self.rng.choice(self.replicas).propose(call)

    async def score(self, call):
        return await self.rng.choice(self.replicas).score(call)

    async def release(self, request_id):
        for replica in self.replicas:
            await replica.release(request_id)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_requests_moved_between_replicas_rebuild_and_stay_exact(model, k):
    draft = tiny_llama(1, layers=1)  # a weaker draft: partial acceptance
    prompt = [2, 7, 1, 8, 2, 8]
    drafter = MovingPool([ModelDrafter(draft), ModelDrafter(draft)], seed=k)
    verifier = MovingPool([ModelVerifier(model), ModelVerifier(model, max_cached_requests=1)], k)
    out, state = run(drafter, verifier, prompt, SamplingParams(temperature=0, max_tokens=40), k)
    assert out == hf_greedy(model, prompt, 40)
    assert state.stats.cache_misses > 3


class Yielding:
    """Lets other requests run between calls, so two requests interleave on one engine."""

    def __init__(self, engine):
        self.engine = engine

    async def propose(self, call):
        await asyncio.sleep(0)
        return await self.engine.propose(call)

    async def score(self, call):
        await asyncio.sleep(0)
        return await self.engine.score(call)

    async def release(self, request_id):
        await self.engine.release(request_id)


def test_interleaved_requests_evicting_each_other_stay_exact(model):
    """Capacity 1 and two live requests: every call finds the other request's cache."""
    drafter = Yielding(ModelDrafter(tiny_llama(1, layers=1), max_cached_requests=1))
    verifier = Yielding(ModelVerifier(model, max_cached_requests=1))
    prompts = {"a": [9, 9, 3], "b": [1, 2]}
    states = {rid: RequestState(Request(rid, tuple(p), SamplingParams(temperature=0, max_tokens=15)))
              for rid, p in prompts.items()}

    async def one(state):
        async for _ in run_rounds(state, drafter, verifier, FixedK(3)):
            pass

    async def both():
        await asyncio.gather(*(one(state) for state in states.values()))

    asyncio.run(both())
    for rid, prompt in prompts.items():
        assert states[rid].output_token_ids == hf_greedy(model, prompt, 15)
        assert states[rid].stats.cache_misses >= 5
    assert verifier.engine.sessions.stats.evictions >= 10


@pytest.mark.parametrize("bad", [[-1], [64], [3, 1000]])
def test_out_of_vocabulary_ids_are_refused_before_touching_the_cache(model, bad):
    from speculative.types import ScoreCall

    verifier = ModelVerifier(model)
    greedy = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="out of range"):
        verifier.score_now(ScoreCall("r", sync([], bad), (), greedy))
    with pytest.raises(ValueError, match="out of range"):
        verifier.score_now(ScoreCall("r", sync([], [1, 2]), tuple(bad), greedy))
    assert len(verifier.sessions) == 0


@pytest.mark.parametrize("mixed", [False, True], ids=["mistral-like", "gemma2-like"])
def test_sliding_window_rollback_past_the_window_stays_exact(mixed):
    from tests.tiny import tiny_sliding

    model = tiny_sliding(5, window=8, mixed=mixed)
    store = SessionStore(4)
    prompt = list(range(3, 15))  # already past the window
    seq = store.apply("r", sync([], prompt))
    seq.feed(served(model), [7, 7, 7, 7], num_logits=5)  # rejected after one token
    seq = store.apply("r", sync(prompt, [7, 40]))
    logits = seq.feed(served(model), [1, 2, 3], num_logits=4)
    torch.testing.assert_close(logits, full_logits(model, prompt + [7, 40, 1, 2, 3])[-4:],
                               atol=ATOL, rtol=0)
    # a rebuild that keeps only an early part of the cache re-prefills (deeper than a crop)
    seq = store.apply("r", sync([], prompt[:4] + [9, 9]))
    logits = seq.feed(served(model), [5], num_logits=2)
    torch.testing.assert_close(logits, full_logits(model, prompt[:4] + [9, 9, 5])[-2:],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("mixed", [False, True], ids=["mistral-like", "gemma2-like"])
def test_sliding_window_pair_decodes_the_targets_greedy_tokens(mixed):
    from tests.tiny import noisy_copy, tiny_sliding

    target = tiny_sliding(6, window=8, mixed=mixed)
    draft = noisy_copy(target, 0.05, seed=7)
    prompt = [5, 9, 2, 33, 17]
    out, state = run(ModelDrafter(draft), ModelVerifier(target), prompt,
                     SamplingParams(temperature=0, max_tokens=40), k=4)
    assert out == hf_greedy(target, prompt, 40)
    assert state.stats.num_accepted_tokens < state.stats.num_draft_tokens  # rollbacks ran


def full(ids) -> PrefixSync:
    return PrefixSync(0, 0, tuple(ids))


def test_the_store_is_bounded_in_tokens_least_recently_used_out():
    store = SessionStore(capacity=100, max_tokens=10)
    store.apply("a", full([1, 2, 3, 4]))
    store.apply("b", full([1, 2, 3, 4]))
    store.apply("a", PrefixSync(4, prefix_hash([1, 2, 3, 4]), (5,)))  # a is the newest now
    store.apply("c", full([1, 2, 3]))  # 5 + 4 + 3 > 10: b (least recently used) goes
    assert "b" not in store and "a" in store and "c" in store
    assert store.tokens == 8 and store.stats.evictions == 1
    with pytest.raises(StaleBase):  # b's next call rebuilds
        store.apply("b", PrefixSync(4, prefix_hash([1, 2, 3, 4]), (5,)))
    store.apply("big", full(range(30)))  # one session beyond the bound stays: it is in use
    assert list(store._sequences) == ["big"]


def test_a_refused_call_evicts_nothing_and_a_rebuild_counts_what_it_replaces():
    """The store at its token bound: a call refused as stale evicts no other session first,
    and a session rebuilt within the bound (its new prefix replacing what it held) neither."""
    store = SessionStore(capacity=100, max_tokens=10)
    store.apply("a", full([1, 2, 3, 4, 5]))
    store.apply("b", full([1, 2, 3, 4, 5]))  # 10 tokens: at the bound
    with pytest.raises(StaleBase):
        store.apply("b", PrefixSync(4, prefix_hash([1, 2, 3, 4]), (9,)))  # an older base
    with pytest.raises(StaleBase):  # its length, another prefix: it would grow by one
        store.apply("b", PrefixSync(5, prefix_hash([1, 2, 3, 4, 6]), (9,)))
    assert "a" in store
    store.apply("b", full([1, 2, 3]))  # rebuilt to 3: 8 tokens
    assert "a" in store and store.stats.evictions == 0 and store.tokens == 8


def test_idle_sessions_are_swept_after_their_ttl(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("engine.kv.time.monotonic", lambda: now[0])
    store = SessionStore(capacity=10, ttl_s=60)
    store.apply("old", full([1]))
    now[0] += 50
    store.apply("new", full([1]))
    now[0] += 20  # old idle 70 s, new 20 s
    assert store.sweep() == 1 and "old" not in store and "new" in store


def test_an_idle_eviction_spares_the_sessions_of_the_running_batch():
    store = SessionStore(8)
    for request_id in ("a", "b", "c"):
        store.apply(request_id, PrefixSync(0, prefix_hash([]), (1, 2)))
    with store.batch(["a", "c"]):
        assert store.evict_idle() and list(store) == ["a", "c"]
        assert not store.evict_idle() and list(store) == ["a", "c"]


def test_an_idle_eviction_takes_the_newest_admitted_unless_one_has_gone_quiet(monkeypatch):
    """Not the least recently used: under a pool too small for its running requests that
    was one between two rounds, whose rebuild then evicted the next (each request rebuilt
    its prefill round after round); the newest admitted rebuilds alone. A session idle past
    STALE_S (a request gone quiet) goes first."""
    now = [1000.0]
    monkeypatch.setattr("engine.kv.time.monotonic", lambda: now[0])
    store = SessionStore(8)
    for stamp, request_id in enumerate(("a", "b", "c", "d")):  # the router's admissions
        store.apply(request_id, PrefixSync(0, prefix_hash([]), (1, 2), float(stamp + 1)))
    store.apply("d", PrefixSync(2, prefix_hash([1, 2]), (3,)))
    store.apply("b", PrefixSync(2, prefix_hash([1, 2]), (3,)))  # used: a, c, d, b
    with store.batch(["d"]):
        assert store.evict_idle() and list(store) == ["a", "d", "b"]  # c, not d nor a
    assert store.evict_idle() and list(store) == ["a", "b"]
    # a request never takes an older one's units (a newcomer waits, as vLLM's)
    assert not store.evict_idle(newer_than=(2.0, "b")) and list(store) == ["a", "b"]
    store.apply("c", PrefixSync(0, prefix_hash([]), (1, 2), 3.0))  # rebuilt, the same stamp
    assert store.evict_idle(newer_than=(2.0, "b")) and list(store) == ["a", "b"]
    now[0] += STALE_S
    store.apply("b", PrefixSync(3, prefix_hash([1, 2, 3]), (4,)))
    assert store.evict_idle() and list(store) == ["b"]  # a, idle STALE_S, before b


def test_the_common_prefix_of_short_lists_is_found_at_every_length_and_difference():
    """Every length up to 90 and every first difference: lengths just past the comparison's
    strides (9 to 16, 73 to 80) put a stride's start between 1 and 8, where a difference
    before it must still be found (trusting such a start gave a longer common prefix, a
    cache kept past a token it does not hold, and passed every unit test)."""
    for n in range(91):
        a = list(range(n))
        for at in range(n):
            b = a[:at] + [-1] + a[at + 1:]
            assert common_prefix_len(a, b) == common_prefix_len(b + [5], a) == at, (n, at)
        assert common_prefix_len(a, a + [1, 2]) == n
