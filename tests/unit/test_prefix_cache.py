"""Prefix caching: a request that starts with a prompt prefix another request committed takes
its full blocks from the pool (shared in engine.paged, copied in engine.regions) and prefills
only the rest, with logits equal to a fresh forward; a hit never sees the other request's
rejected drafts; shared blocks return to the free list when the last reference goes."""

import asyncio

import pytest
import torch

from engine import cache as kv_cache
from engine.kv import Sequence, SessionStore
from engine.runner import serving_runner
from speculative.driver import Generation
from speculative.frontend import RequestFrontEnd
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ScoreCall
from tests.tiny import tiny_llama, tiny_sliding
from verifier.engine import ModelVerifier

ATOL = 1e-4  # float reassociation only (see test_kv)
BACKENDS = ["paged", "regions"]
PROMPT = [(5 * i) % 60 + 1 for i in range(40)]  # two full blocks of 16, and 8 more


def served(backend: str, model=None):
    return serving_runner(model or tiny_llama(1), "paged", backend, kv_cache_tokens=4096)


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def sync(known, new):
    return PrefixSync(len(known), prefix_hash(known), tuple(new))


def start(store, runner, request_id, prompt, extra=(), num_logits=1):
    sequence = store.apply(request_id, sync([], prompt))
    return sequence, runner.forward([sequence.segment(runner, list(extra), num_logits)])[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("released", [False, True], ids=["holder-live", "holder-released"])
def test_a_hit_takes_the_full_blocks_and_equals_a_fresh_forward(backend, released):
    runner = served(backend)
    store = SessionStore(8)
    start(store, runner, "a", PROMPT)
    store.apply("a", sync(PROMPT, [7]))  # a's next call: its prompt blocks are published
    if released:
        store.release("a")
    tail = [9, 8, 7, 6]
    b, logits = start(store, runner, "b", PROMPT[:36] + tail, num_logits=3)
    assert b.cached_tokens == 32 and len(b.cached_ids) == 40
    torch.testing.assert_close(logits, full_logits(runner.model, PROMPT[:36] + tail)[-3:],
                               atol=ATOL, rtol=0)


def rejected_drafts_error(backend: str) -> tuple[int, float]:
    """a feeds 20 drafts after its 32-token prompt, then commits 16 other tokens without
    feeding them yet (its cache still holds the drafts there); b's prompt is a's committed
    prefix and more. (b's cached tokens, b's largest gap to a fresh forward.)"""
    runner = served(backend, tiny_sliding(2))  # past its window too
    store = SessionStore(8)
    start(store, runner, "a", PROMPT[:32], extra=[11] * 20, num_logits=21)
    store.apply("a", sync(PROMPT[:32], [12] * 16))
    ids = PROMPT[:32] + [12] * 16 + [5] * 4
    b, logits = start(store, runner, "b", ids, num_logits=4)
    return b.cached_tokens, float((logits - full_logits(runner.model, ids)[-4:]).abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hit_never_sees_the_holders_rejected_drafts(backend):
    cached, error = rejected_drafts_error(backend)
    assert cached == 32 and error < ATOL  # the block holding drafts is not offered


def test_the_test_sees_a_block_published_by_its_tokens_not_its_contents(monkeypatch):
    """Mutant: a cache names the committed tokens' blocks whatever its positions hold."""
    def careless(self):
        if self.cache is not None and self.cache.pool is not None:
            end = min(len(self.committed), self.cache.length)
            self.cache.publish(self.committed[:end - end % self.cache.pool.block_size])

    monkeypatch.setattr(Sequence, "publish", careless)
    cached, error = rejected_drafts_error("paged")
    assert cached == 48 and error > 0.01


def test_shared_blocks_are_freed_when_their_last_reference_goes():
    runner = served("paged")
    pool = runner.pool
    store = SessionStore(8)
    free = pool.free_units
    start(store, runner, "a", PROMPT)
    store.apply("a", sync(PROMPT, [7]))
    b, _ = start(store, runner, "b", PROMPT[:36])
    shared = b.cache.units[:2]
    assert shared == store_units(store, "a")[:2] and all(pool.refs[u] == 2 for u in shared)
    store.drop("a")  # the holder goes: b still reads the shared blocks
    assert all(pool.refs[u] == 1 for u in shared) and not set(shared) & set(pool._free)
    c, logits = start(store, runner, "c", [50] * 60)  # allocates over what a gave back
    assert not set(shared) & set(c.cache.units)
    b = store.apply("b", sync(PROMPT[:36], [3]))
    logits = runner.forward([b.segment(runner, [], 1)])[0]
    torch.testing.assert_close(logits, full_logits(runner.model, PROMPT[:36] + [3])[-1:],
                               atol=ATOL, rtol=0)
    store.clear()
    assert pool.free_units == free and not any(pool.refs)


def test_the_test_sees_a_share_that_forgets_its_reference(monkeypatch):
    """Mutant: adopting blocks without counting the reference; the holder's release frees
    blocks the hit still reads, and a later request overwrites them."""
    monkeypatch.setattr(kv_cache.UnitPool, "share", lambda self, units: list(units))
    with pytest.raises(AssertionError):
        test_shared_blocks_are_freed_when_their_last_reference_goes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_stays_found_while_a_request_that_took_it_holds_it(backend):
    """b adopts a's prompt and publishes it too: once a is gone (its cache evicted), a new
    request still finds the prefix in b, which holds it."""
    runner = served(backend)
    store = SessionStore(8)
    start(store, runner, "a", PROMPT)
    store.apply("a", sync(PROMPT, [7]))
    b, _ = start(store, runner, "b", PROMPT[:36])
    store.apply("b", sync(PROMPT[:36], [3]))
    assert b.cached_tokens == 32
    store.drop("a")
    c, logits = start(store, runner, "c", PROMPT[:34])
    assert c.cached_tokens == 32
    torch.testing.assert_close(logits, full_logits(runner.model, PROMPT[:34])[-1:], atol=ATOL,
                               rtol=0)
    store.clear()
    assert not runner.pool.prefixes.holders and not any(runner.pool.refs)


def test_a_rebuild_from_its_own_retired_cache_reports_only_prompt_tokens_cached():
    """An evicted session rebuilt mid-output takes its own retired blocks back, output
    included: usage's cached_tokens counts the prompt's only."""
    greedy = SamplingParams(temperature=0.0)
    verifier = ModelVerifier(served("paged"), max_cached_requests=1)
    prompt = PROMPT[:20]
    committed = list(prompt)
    scores = verifier.score_now(ScoreCall("a", sync([], prompt), (), greedy, prompt_len=20))
    for _ in range(40):
        new = [int(scores.target_token_ids[0])]
        scores = verifier.score_now(ScoreCall("a", sync(committed, new), (), greedy,
                                              prompt_len=20))
        committed += new
    verifier.score_now(ScoreCall("b", sync([], [60, 61, 62]), (), greedy))  # a evicted
    committed.append(int(scores.target_token_ids[0]))
    rebuilt = verifier.score_now(ScoreCall("a", sync([], committed), (), greedy,
                                           prompt_len=20))
    assert rebuilt.cached_tokens == 20 < len(committed) - 16


def store_units(store, request_id):
    return store._sequences[request_id].cache.units


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_verify_with_a_hit_equals_one_without(backend):
    """Through the verifier: the second request reports its cached tokens and scores the
    same as on a verifier that never saw the first."""
    greedy = SamplingParams(temperature=0.0)
    verifier = ModelVerifier(served(backend))
    fresh = ModelVerifier(served(backend))
    first = ScoreCall("a", sync([], PROMPT), (3, 4), greedy)
    assert verifier.score_now(first).cached_tokens == 0
    verifier.score_now(ScoreCall("a", sync(PROMPT, [3]), (5,), greedy))  # publishes
    second = ScoreCall("b", sync([], PROMPT + [9]), (1, 2, 3), greedy, prompt_len=41)
    hit, alone = verifier.score_now(second), fresh.score_now(second)
    assert hit.cached_tokens == 32 and alone.cached_tokens == 0
    assert hit.target_token_ids == alone.target_token_ids


def test_block_names_are_128_bits():
    """A collision shares one request's keys with another's: at 64 bits a client could
    build one in about 2^32 hashes."""
    from engine.cache import block_name

    names = {block_name(previous, list(range(i, i + 16))) for previous in (0, 1) for i in range(8)}
    assert len(names) == 16 and max(name.bit_length() for name in names) > 64


def test_a_rebuild_into_shared_blocks_copies_them_and_withdraws_what_it_cuts():
    """b took a's two prompt blocks and published them too; rebuilt with another prompt
    that leaves the second block at position 20, b writes into a copy (a's keys stay), and
    the name of the block it cut is withdrawn: once a is gone, a new request with a's
    prompt finds only the first block, and its logits equal a fresh forward."""
    runner = served("paged")
    pool, size = runner.pool, runner.pool.block_size
    store = SessionStore(8)
    start(store, runner, "a", PROMPT)
    store.apply("a", sync(PROMPT, [7]))
    b, _ = start(store, runner, "b", PROMPT[:36])
    store.apply("b", sync(PROMPT[:36], [3]))  # b publishes the blocks it shares
    second = b.cache.units[1]
    slots = slice(second * size, (second + 1) * size)
    held = pool.keys[:, slots].clone()
    b = store.apply("b", sync([], PROMPT[:20] + [9] * 20))  # a rebuild: 20 tokens kept
    runner.forward([b.segment(runner, [], 1)])
    assert b.cache.units[1] != second and pool.refs[second] == 1
    assert torch.equal(pool.keys[:, slots], held)  # a's block untouched
    store.drop("a")
    c, logits = start(store, runner, "c", PROMPT[:34])
    assert c.cached_tokens == size
    torch.testing.assert_close(logits, full_logits(runner.model, PROMPT[:34])[-1:], atol=ATOL,
                               rtol=0)


def test_a_write_into_a_shared_block_is_counted_as_a_block_to_copy():
    """missing() counts, beside the new blocks, each block it would write that another cache
    also holds (its copy), so admission reserves what the feed's copy on write takes."""
    from engine.paged import BlockPool, PagedCache

    pool = BlockPool(1, 8, 1, 2, torch.float32, "cpu", block_size=4)
    holder = PagedCache(pool)
    holder.reserve(8)
    taker = PagedCache(pool)
    taker.adopt(holder, 8)  # both hold blocks 0 and 1 of the prefix
    assert taker.missing(8, 8) == 0  # a feed after them writes nothing shared
    assert taker.missing(10, 6) == 1 + 1  # block 1 copied, block 2 new
    assert taker.missing(10, 2) == 2 + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_with_one_prompt_leave_one_retired_cache_not_one_each(backend):
    """Requests of one prompt whose outputs fill no block of their own (a classifier's, a
    health check's) adopt the first one's blocks and publish that same chain. Each was kept
    retired at its release: in engine.paged it held only shared blocks, so no allocation ever
    needed it gone, and the retired caches and the prefix index grew by one a request
    (3,000 requests: 3,000 of each, with 254 of 256 blocks free). A later request still
    finds the prefix."""
    runner = served(backend)
    pool, store = runner.pool, SessionStore(8)
    for i in range(20):
        sequence, _ = start(store, runner, f"r{i}", PROMPT)
        assert sequence.cached_tokens == (0 if i == 0 else 32)
        store.apply(f"r{i}", sync(PROMPT, [7]))
        store.release(f"r{i}")
    assert len(pool.retired) == 1
    assert [len(held) for held in pool.prefixes.holders.values()] == [1, 1]
    later, _ = start(store, runner, "later", PROMPT[:36])
    assert later.cached_tokens == 32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_held_by_a_running_request_outlives_its_failure(backend):
    """A request released while another of its prompt is still running keeps its retired
    cache: the running one holds the same chain, but its call may yet fail (its cache freed
    at once) and the prefix would go with it (freed beside a running holder, a later request
    of that prompt prefilled it all again)."""
    runner = served(backend)
    store = SessionStore(8)
    start(store, runner, "a", PROMPT)
    store.apply("a", sync(PROMPT, [7]))  # a publishes its two blocks
    start(store, runner, "b", PROMPT)  # b takes them, and publishes the same chain
    store.apply("b", sync(PROMPT, [7]))
    store.release("a")
    store.drop("b")  # b's next call fails
    later, _ = start(store, runner, "later", PROMPT)
    assert later.cached_tokens == 32


class EvictingAfter:
    """The verifier, whose request's session goes (as a full pool evicts it) before its
    `calls`-th call: that call answers REBUILD, and the rebuild takes its blocks back."""

    def __init__(self, verifier: ModelVerifier, calls: int) -> None:
        self.verifier, self.left = verifier, calls

    async def score(self, call):
        self.left -= 1
        if self.left == 0:
            self.verifier.sessions.release(call.request_id)
        return await self.verifier.score(call)

    async def release(self, request_id):
        await self.verifier.release(request_id)


def test_usage_counts_the_prompts_cached_tokens_of_its_prefill_not_of_a_rebuild():
    """A request whose prompt missed the prefix cache computed it whole: its session
    evicted mid-output and rebuilt from its own retired blocks, usage still reports no
    cached prompt token (vLLM sets it once, at the first schedule); a prompt that hit the
    cache at its prefill reports what it took."""
    verifier = ModelVerifier(served("paged"))
    greedy = SamplingParams(temperature=0.0, max_tokens=40)

    def usage(request_id: str, scored) -> dict:
        plan = RequestFrontEnd().plan(request_id, PROMPT, greedy, num_speculative_tokens=0,
                                      plain_steps=1)
        choice = plan.choices[0]
        generation = Generation(choice.request)
        asyncio.run(generation.run(None, scored, choice.policy))  # K = 0: no drafter
        return plan.usage([generation]) | {"misses": generation.stats.cache_misses}

    missed = usage("a", EvictingAfter(verifier, 5))
    assert missed["misses"] == 1 and missed["prompt_tokens_details"]["cached_tokens"] == 0
    hit = usage("b", verifier)  # a's blocks are published now
    assert hit["prompt_tokens_details"]["cached_tokens"] == 32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_salt_shares_prompt_blocks_only_within_its_salt(backend):
    """vLLM's cache_salt: requests share prompt blocks only with requests of their salt, so
    a tenant's cached_tokens say nothing of another's prompts (before, every request's
    blocks were every request's), and a salted hit scores as a request never cached."""
    verifier, fresh = ModelVerifier(served(backend)), ModelVerifier(served(backend))

    def greedy(salt: str = "") -> SamplingParams:
        return SamplingParams(temperature=0.0, cache_salt=salt)

    def cached(request_id: str, salt: str = "", scorer=verifier) -> tuple[int, tuple]:
        call = ScoreCall(request_id, sync([], PROMPT + [9]), (1, 2), greedy(salt),
                         prompt_len=41)
        scores = scorer.score_now(call)
        scorer.score_now(ScoreCall(request_id, sync(PROMPT + [9], [3]), (), greedy(salt)))
        return scores.cached_tokens, scores.target_token_ids  # the second call published

    assert cached("a", "tenant-a")[0] == 0
    assert cached("b")[0] == cached("c", "tenant-b")[0] == 0  # another salt, or none
    assert cached("d", "tenant-a") == (32, cached("e", "tenant-a", fresh)[1])
    assert cached("f")[0] == 32  # the unsalted among themselves, as before


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rebuild_that_cuts_a_blocks_last_position_withdraws_that_block(backend):
    """a published its two prompt blocks, then a rebuild kept 31 tokens (all of the second
    block but its last position) and wrote another token there: that block's name is
    withdrawn, so a new request with a's prompt takes only the first block, and its logits
    equal a fresh forward (kept named, it read the other token's keys at position 31)."""
    runner = served(backend)
    size = runner.pool.block_size
    store = SessionStore(8)
    start(store, runner, "a", PROMPT)
    store.apply("a", sync(PROMPT, [7]))  # a's prompt blocks are published
    a = store.apply("a", sync([], PROMPT[:2 * size - 1] + [3] * 9))  # 31 tokens kept
    runner.forward([a.segment(runner, [], 1)])
    b, logits = start(store, runner, "b", PROMPT[:34])
    assert b.cached_tokens == size
    torch.testing.assert_close(logits, full_logits(runner.model, PROMPT[:34])[-1:], atol=ATOL,
                               rtol=0)
