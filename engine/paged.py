"""A paged KV cache: one pool of blocks per model replica, a block table per request.

Memory: one `BlockPool` per model replica holds every layer's keys and values in blocks of
`block_size` positions, allocated once ([layers, blocks * block_size, kv_heads, head_dim]).
A request's cache (`PagedCache`) is a block table and a length: feeding writes its new keys
and values into its slots, a rollback is a length reset (the blocks stay, the next feed
overwrites them), and freeing returns its blocks to the pool. Nothing is ever copied or
concatenated per step. Sliding-window layers keep every position too, so a rollback never
needs a re-prefill (memory is the full context's, as vLLM's non-sliding blocks).

engine.lean's forward writes and reads these blocks.
"""

import math
import os

import torch

BLOCK_SIZE = 16


class KVCacheFull(RuntimeError):
    """The block pool has no free block left for a feed."""


class BlockPool:
    """Every layer's keys and values, in blocks. Block 0 is zeros and never handed out:
    the padding of a gathered batch reads it."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int,
                 dtype, device, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks, got {num_blocks}")
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        # empty: a CPU allocation this large is backed by pages only as blocks are written
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.keys[:, :block_size].zero_()
        self.values[:, :block_size].zero_()
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack: 1, 2, .. first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise KVCacheFull(f"the KV cache needs {count} more blocks of {self.block_size} "
                              f"tokens, {len(self._free)} of {self.num_blocks - 1} are free")
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedCache:
    """One request's keys and values in a BlockPool: a block table and a length."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.blocks, self.length = pool, [], 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first max_length positions (negative: drop that many), as DynamicCache."""
        self.length = max(0, self.length + max_length if max_length < 0 else
                          min(max_length, self.length))

    def missing_blocks(self, length: int) -> int:
        """Blocks it lacks to hold `length` positions (0 when it has them)."""
        return max(0, -(-length // self.pool.block_size) - len(self.blocks))

    def reserve(self, length: int) -> None:
        """Blocks for `length` positions (raises KVCacheFull, holding what it had)."""
        needed = self.missing_blocks(length)
        if needed > 0:
            self.blocks.extend(self.pool.allocate(needed))

    def slots(self, start: int, end: int, device) -> torch.Tensor:
        """Pool slot of each position in [start, end)."""
        size = self.pool.block_size
        positions = torch.arange(start, end)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return (table[positions // size] * size + positions % size).to(device)

    def free(self) -> None:
        self.pool.release(self.blocks)
        self.blocks, self.length = [], 0

    def __del__(self) -> None:  # a dropped sequence gives its blocks back
        if self.blocks:
            self.free()



def blocks_for(tokens: int, sequences: int, extra_per_sequence: int,
               block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` committed tokens over `sequences` caches, each with up to
    `extra_per_sequence` uncommitted (drafted) positions and a partly filled last block,
    plus the zero block."""
    per_sequence = math.ceil((extra_per_sequence + block_size - 1) / block_size) + 1
    return math.ceil(tokens / block_size) + sequences * per_sequence + 1


CPU_KV_TOKENS = 262_144  # at most, on a CPU (pages back only the blocks written: BlockPool)
CPU_MEMORY_FOR_KV = 0.3  # of the memory available when a CPU pool is built, at most
GPU_MEMORY_LEFT = 0.1  # of the GPU's memory, left free for activations beside the pool


class KVBudgetTooSmall(ValueError):
    """The memory left for a KV pool cannot hold one request at the model's context."""


def kv_bytes_per_token(model) -> int:
    config, weight = model.config, model.get_input_embeddings().weight
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * weight.element_size()


def available_memory_bytes() -> int:
    """The host memory a new allocation can take now: Linux's MemAvailable (free memory plus
    what the page cache can give back), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(device: torch.device) -> int:
    """The bytes a new pool may take: on a GPU its free memory less GPU_MEMORY_LEFT of the
    total; on a CPU CPU_MEMORY_FOR_KV of the memory available (Linux refuses one allocation
    larger than memory, even if its pages would never be touched: measured)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - GPU_MEMORY_LEFT * total))
    return int(CPU_MEMORY_FOR_KV * available_memory_bytes())


def kv_pool_blocks(model, configured_tokens: int | None, max_sequences: int,
                   max_new_per_sequence: int, block_size: int = BLOCK_SIZE) -> int:
    """How many blocks the pool holds: enough for `configured_tokens` when set; else what
    the device's memory budget holds (on a CPU at most CPU_KV_TOKENS' worth), never less than
    one request at the model's full context (KVBudgetTooSmall, saying how much is missing)."""
    if configured_tokens is not None:
        return blocks_for(configured_tokens, max_sequences, max_new_per_sequence, block_size)
    device = model.get_input_embeddings().weight.device
    block_bytes = kv_bytes_per_token(model) * block_size
    blocks = kv_budget_bytes(device) // block_bytes
    if device.type != "cuda":
        blocks = min(blocks, blocks_for(CPU_KV_TOKENS, max_sequences, max_new_per_sequence,
                                        block_size))
    context = getattr(model.config, "max_position_embeddings", None) or 2048
    minimum = blocks_for(context, 1, max_new_per_sequence, block_size)
    if blocks < minimum:
        raise KVBudgetTooSmall(
            f"the KV cache of one request at the model's {context}-token context takes "
            f"{minimum * block_bytes / 2**20:.0f} MiB, but only {blocks * block_bytes / 2**20:.0f}"
            f" MiB of {device.type} memory is left for it: free memory, use a smaller dtype, "
            f"or set kv_cache_tokens")
    return blocks
