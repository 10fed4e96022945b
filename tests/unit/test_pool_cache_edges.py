"""engine.cache.PoolCache's crop as engine.kv calls it (crop(-removed)), and adopt_prefix's
limit. A crop by 0 keeps the length and every published block (else each call withdrew the
request's prompt blocks, and a later request's prefix hit, and its cached_tokens, went with
them); a crop that cuts a block's last position withdraws that block's name (else a later
request with the old prompt adopted a block whose last position holds another token's keys:
not its target's logits)."""

import torch

from engine.cache import block_names
from engine.paged import BlockPool, PagedCache

TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]  # two blocks of 4


def published_cache() -> tuple[BlockPool, PagedCache]:
    pool = BlockPool(1, 8, 1, 2, torch.float32, "cpu", block_size=4)
    cache = PagedCache(pool)
    cache.reserve(len(TOKENS))
    cache.length = len(TOKENS)
    cache.publish(TOKENS)
    return pool, cache


def test_a_crop_by_nothing_keeps_the_length_and_the_published_blocks():
    pool, cache = published_cache()
    cache.crop(-0)
    assert cache.length == 8 and len(cache.names) == 2
    assert pool.prefixes.longest(block_names(TOKENS, 4)) == (cache, 2)


def test_a_crop_into_a_block_withdraws_it_and_keeps_the_one_before():
    pool, cache = published_cache()
    cache.crop(-1)  # position 7, the second block's last, is cut
    assert cache.length == 7 and len(cache.names) == 1
    assert pool.prefixes.longest(block_names(TOKENS, 4)) == (cache, 1)
    cache.crop(-3)
    assert cache.length == 4 and len(cache.names) == 1
    cache.crop(3)  # a positive count keeps that many
    assert cache.length == 3 and cache.names == []
    assert pool.prefixes.longest(block_names(TOKENS, 4)) == (None, 0)


def test_a_prefix_hit_adopts_no_block_past_its_limit():
    """adopt_prefix takes whole blocks up to `limit` (engine.kv: all but the positions whose
    logits are asked), so cached_tokens counts only prompt tokens not recomputed."""
    pool, holder = published_cache()
    assert PagedCache(pool).adopt_prefix(TOKENS, 7) == 4
    assert PagedCache(pool).adopt_prefix(TOKENS + [1], 8) == 8
    assert PagedCache(pool).adopt_prefix(TOKENS, 3) == 0
