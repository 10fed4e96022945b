"""The KV pool's size on a CPU follows the memory available, and a budget that cannot hold one
request at the model's context is a clear error, not an allocator crash (a fixed 262,144
positions was 42 GB for the fp32 scaled target on a 24 GB machine)."""

import pytest

from engine import paged
from engine.lean import serving_engine
from engine.paged import BLOCK_SIZE, KVBudgetTooSmall, blocks_for, kv_bytes_per_token, kv_pool_blocks
from tests.tiny import tiny_llama

SEQUENCES, NEW = 4, 8


def test_cpu_pool_is_a_share_of_available_memory(monkeypatch):
    model = tiny_llama(0)
    block_bytes = kv_bytes_per_token(model) * BLOCK_SIZE
    minimum = blocks_for(model.config.max_position_embeddings, 1, NEW)
    available = int(10 * minimum * block_bytes / paged.CPU_MEMORY_FOR_KV)
    monkeypatch.setattr(paged, "available_memory_bytes", lambda: available)
    blocks = kv_pool_blocks(model, None, SEQUENCES, NEW)
    assert blocks == int(paged.CPU_MEMORY_FOR_KV * available) // block_bytes
    assert 10 * minimum - 1 <= blocks <= 10 * minimum


def test_cpu_pool_is_capped_when_memory_is_plenty(monkeypatch):
    monkeypatch.setattr(paged, "available_memory_bytes", lambda: 2**50)
    blocks = kv_pool_blocks(tiny_llama(0), None, SEQUENCES, NEW)
    assert blocks == blocks_for(paged.CPU_KV_TOKENS, SEQUENCES, NEW)


def test_configured_tokens_win(monkeypatch):
    monkeypatch.setattr(paged, "available_memory_bytes", lambda: 0)
    assert kv_pool_blocks(tiny_llama(0), 64, SEQUENCES, NEW) == blocks_for(64, SEQUENCES, NEW)


def test_too_little_memory_is_a_clear_error(monkeypatch):
    model = tiny_llama(0)
    monkeypatch.setattr(paged, "available_memory_bytes", lambda: 1000)
    with pytest.raises(KVBudgetTooSmall, match="context takes .* MiB.*set kv_cache_tokens"):
        serving_engine(model, "paged")
