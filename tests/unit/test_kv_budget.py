"""The KV pool's size on a CPU follows the memory available, less one forward's activations,
for both pool kinds; a budget that cannot hold one request at the model's context is a
clear error, not an allocator crash (a fixed 262,144 positions was 42 GB for the fp32
scaled target on a 24 GB machine)."""

import pytest

from engine import memory
from engine.cache import BLOCK_SIZE
from engine.memory import KVBudgetTooSmall, activation_bytes, kv_bytes_per_token
from engine.paged import blocks_for, kv_pool_blocks
from engine.regions import region_count
from engine.runner import serving_runner
from tests.tiny import tiny_llama

SEQUENCES, NEW = 4, 8


def budget(model, available: int) -> int:
    return int(memory.CPU_MEMORY_FOR_KV * available) - activation_bytes(model)


def test_cpu_pool_is_a_share_of_available_memory_less_activations(monkeypatch):
    model = tiny_llama(0)
    block_bytes = kv_bytes_per_token(model) * BLOCK_SIZE
    minimum = blocks_for(model.config.max_position_embeddings, 1, NEW)
    available = int((10 * minimum * block_bytes + activation_bytes(model))
                    / memory.CPU_MEMORY_FOR_KV)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: available)
    blocks = kv_pool_blocks(model, None, NEW)
    assert blocks == budget(model, available) // block_bytes
    assert 10 * minimum - 1 <= blocks <= 10 * minimum
    assert blocks * block_bytes <= memory.CPU_MEMORY_FOR_KV * available


def test_regions_fit_the_budget_in_full_and_at_most_two_per_session(monkeypatch):
    model = tiny_llama(0)
    region_bytes = model.config.max_position_embeddings * kv_bytes_per_token(model)
    available = int((5.5 * region_bytes + activation_bytes(model)) / memory.CPU_MEMORY_FOR_KV)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: available)
    assert region_count(model, None, SEQUENCES) == 5
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**50)
    assert region_count(model, None, SEQUENCES) == 2 * SEQUENCES + 1


def test_auto_takes_regions_on_a_cpu_only_when_a_full_batch_fits(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**40)
    assert serving_runner(tiny_llama(0), max_sequences=64).attention == "regions"
    model = tiny_llama(0)
    region_bytes = model.config.max_position_embeddings * kv_bytes_per_token(model)
    available = int((8 * region_bytes + activation_bytes(model)) / memory.CPU_MEMORY_FOR_KV)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: available)
    assert serving_runner(model, max_sequences=64).attention == "paged"


def test_configured_tokens_win_and_are_the_pools_positions(monkeypatch):
    """As vLLM's num_gpu_blocks_override: the positions asked for in whole blocks, and the
    zero block (no room per cached request on top: 4,096 for an 8B model took 7x)."""
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 0)
    assert kv_pool_blocks(tiny_llama(0), 64, NEW) == 64 // BLOCK_SIZE + 1
    assert kv_pool_blocks(tiny_llama(0), 65, NEW) == 64 // BLOCK_SIZE + 2
    runner = serving_runner(tiny_llama(0), "paged", "paged", kv_cache_tokens=4096,
                            max_sequences=256)
    assert runner.pool.free_units * BLOCK_SIZE == 4096


@pytest.mark.parametrize("attention", ["paged", "regions"])
def test_too_little_memory_is_a_clear_error(monkeypatch, attention):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1000)
    with pytest.raises(KVBudgetTooSmall, match="context takes .* MiB.*set kv_cache_tokens"):
        serving_runner(tiny_llama(0), "paged", attention)
