"""The KV pools' sizes at their bounds, and what a region plan reads. A memory budget one unit
short of one request at the model's context is refused at start-up (KVBudgetTooSmall, not a
pool that answers every full-context request 429 or an allocator's ValueError); configured
tokens are whole regions beside the never-handed-out region 0; a plan zeroes every position
its rows read, so a masked read never meets what a region's last owner left (a NaN there
makes the row's output NaN). And engine.memory's inputs to those sizes: a token's bytes, the
defaults of a config that names no head_dim or context, a GPU's margin, MemAvailable's kB."""

import io
from types import SimpleNamespace

import pytest
import torch

from engine import memory, paged, regions
from engine.batch import Segment
from engine.cache import BLOCK_SIZE
from engine.memory import KVBudgetTooSmall, context_length, kv_bytes_per_token, kv_shape
from engine.paged import blocks_for, kv_pool_blocks
from engine.regions import RegionCache, RegionPlan, RegionPool, region_count
from engine.runner import serving_runner
from tests.tiny import tiny_llama

NEW = 8  # drafted positions per sequence


def test_a_block_budget_one_short_of_a_full_context_request_is_refused(monkeypatch):
    model = tiny_llama(0)
    block_bytes = kv_bytes_per_token(model) * BLOCK_SIZE
    minimum = blocks_for(model.config.max_position_embeddings, 1, NEW)
    monkeypatch.setattr(paged, "kv_budget_bytes", lambda _: minimum * block_bytes)
    assert kv_pool_blocks(model, None, NEW) == minimum
    monkeypatch.setattr(paged, "kv_budget_bytes", lambda _: (minimum - 1) * block_bytes)
    with pytest.raises(KVBudgetTooSmall, match="set kv_cache_tokens"):
        kv_pool_blocks(model, None, NEW)


def test_the_minimum_block_count_counts_the_zero_block():
    """512 positions in 32 blocks, a sequence's drafts and partly filled blocks 3 (1 + 1
    without drafts), and block 0."""
    assert blocks_for(512, 1, NEW) == 32 + 3 + 1
    assert blocks_for(0, 2, 0) == 2 * 2 + 1


def test_a_region_budget_of_one_region_is_refused(monkeypatch):
    """Region 0 is never handed out: one region in the budget holds no request."""
    model = tiny_llama(0)
    region_bytes = model.config.max_position_embeddings * kv_bytes_per_token(model)
    monkeypatch.setattr(regions, "kv_budget_bytes", lambda _: 2 * region_bytes)
    assert region_count(model, None, 4) == 2
    monkeypatch.setattr(regions, "kv_budget_bytes", lambda _: 2 * region_bytes - 1)
    with pytest.raises(KVBudgetTooSmall, match="set kv_cache_tokens"):
        region_count(model, None, 4)


def test_configured_tokens_are_whole_regions_beside_region_zero():
    model = tiny_llama(0)
    span = model.config.max_position_embeddings
    assert region_count(model, span, 4) == 2
    assert region_count(model, span + 1, 4) == 3
    runner = serving_runner(model, "paged", "regions", kv_cache_tokens=2 * span)
    assert runner.pool.free_units == 2


def segment(pool: RegionPool, region: int, start: int, length: int) -> Segment:
    cache = RegionCache(pool)
    cache.units = [region]
    return Segment(cache, list(range(1, length + 1)), start, 1)


def test_a_region_plan_zeroes_every_position_its_rows_read():
    """Region 1 was zeroed to its first plan's end and ZERO_AHEAD past it; a later batch
    beside a longer request reads region 1 one position further than that: it is zeroed
    too, over the NaN a last owner left."""
    pool = RegionPool(1, 4, 1, 256, 2, torch.float32, "cpu")
    pool.keys.fill_(float("nan"))
    pool.values.fill_(float("nan"))
    first = RegionPlan([segment(pool, 1, 0, 10)], pool, {None}, 1, "cpu")
    reach = first.queries.max_len + regions.ZERO_AHEAD
    assert pool.written[1] == reach
    batch = [segment(pool, 1, 10, 1), segment(pool, 2, 0, reach + 1)]
    plan = RegionPlan(batch, pool, {None}, 1, "cpu")
    assert plan.queries.max_len == reach + 1
    for tensor in (pool.keys, pool.values):
        assert torch.isfinite(tensor[0, 1:3, :, :plan.queries.max_len]).all()


def fake_model(device: str = "cpu", **config) -> SimpleNamespace:
    """A loaded model as engine.memory reads it: its config, its embedding's device."""
    weight = SimpleNamespace(device=torch.device(device), element_size=lambda: 2)
    return SimpleNamespace(config=SimpleNamespace(**config),
                           get_input_embeddings=lambda: SimpleNamespace(weight=weight))


def test_a_tokens_kv_bytes_are_what_a_block_pool_allocates_per_position():
    model = tiny_llama(0)
    layers, kv_heads, head_dim = kv_shape(model)
    pool = paged.BlockPool(layers, 2, kv_heads, head_dim, torch.float32, "cpu")
    per_position = (pool.keys.nbytes + pool.values.nbytes) // (2 * BLOCK_SIZE)
    assert kv_bytes_per_token(model) == per_position == 2 * 2 * 2 * 8 * 4


def test_a_config_without_head_dim_or_context_gets_transformers_defaults():
    """head_dim: the hidden size over the query heads (not the KV heads); no context: 2048."""
    model = fake_model(num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                       num_hidden_layers=3)
    assert kv_shape(model) == (3, 2, 8)
    assert context_length(model) == 2048
    model.config.num_key_value_heads = None  # multi-head attention
    assert kv_shape(model) == (3, 8, 8)


def test_a_gpu_budget_is_its_free_memory_less_a_tenth_of_the_total(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * gib, 100 * gib))
    assert memory.kv_budget_bytes(fake_model("cuda")) == 40 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * gib, 100 * gib))
    assert memory.kv_budget_bytes(fake_model("cuda")) == 0


def test_available_memory_is_linuxs_memavailable_in_bytes(monkeypatch):
    meminfo = "MemTotal:  8000 kB\nMemFree:  1000 kB\nMemAvailable:  2048 kB\n"
    monkeypatch.setattr(memory, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert memory.available_memory_bytes() == 2048 * 1024
