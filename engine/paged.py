"""A paged KV cache and the reference attention backend: blocks gathered, then SDPA.

Memory: one `BlockPool` per model replica holds every layer's keys and values in blocks of
`block_size` positions, allocated once ([layers, blocks * block_size, kv_heads, head_dim]).
A request's cache (`PagedCache`) is a block table and a length: feeding writes its new keys
and values into its slots, a rollback is a length reset (the blocks stay, the next feed
overwrites them). Sliding-window layers keep every position too, so a rollback never needs a
re-prefill. A prefix hit shares the holder's full blocks (reference counts, engine.cache);
a feed that would write into a block another cache also holds copies it first, so a
rollback or rebuild never writes into a shared block.

`PagedAttention` gathers each request's keys and values from its blocks into [B, H_kv,
max_len, D] buffers kept from one forward to the next, and runs SDPA with the GQA group
folded into the query axis (engine.attention). It serves any device and is the reference
the other backends are tested against; on a CPU the gather reads a batch's KV bytes a
second time and writes them once more (engine.regions reads them in place).
"""

import torch

from engine import attention
from engine.cache import BLOCK_SIZE, PoolCache, UnitPool
from engine.memory import context_length, kv_budget_bytes, kv_bytes_per_token, too_small


class BlockPool(UnitPool):
    """Every layer's keys and values, in blocks. Block 0 is zeros and never handed out:
    the padding of a gathered batch reads it."""

    unit_name = "blocks"

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int,
                 dtype, device, block_size: int = BLOCK_SIZE) -> None:
        super().__init__(num_blocks, block_size)
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        # empty: a CPU allocation this large is backed by pages only as blocks are written
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.keys[:, :block_size].zero_()
        self.values[:, :block_size].zero_()
        self.max_tokens = (num_blocks - 1) * block_size  # one cache, at most

    def copy_block(self, source: int, target: int) -> None:
        size = self.block_size
        for tensor in (self.keys, self.values):
            tensor[:, target * size:(target + 1) * size] = tensor[:, source * size:
                                                                   (source + 1) * size]


class PagedCache(PoolCache):
    """One request's keys and values in a BlockPool: a block table and a length."""

    def missing(self, length: int, start: int | None = None) -> int:
        """Blocks it lacks to hold `length` positions and write from `start` on: new ones,
        and a copy of each block it would write that another cache also holds."""
        size = self.pool.block_size
        shared = 0 if start is None else sum(
            1 for unit in self.units[start // size:-(-length // size)] if self.pool.refs[unit] > 1)
        return max(0, -(-length // size) - len(self.units)) + shared

    def reserve(self, length: int, start: int | None = None) -> None:
        """Blocks for `length` positions, the shared ones from `start` on copied (raises
        KVCacheFull, holding what it had)."""
        needed = max(0, -(-length // self.pool.block_size) - len(self.units))
        if needed > 0:
            self.units.extend(self.pool.allocate(needed))
        if start is not None:
            self.writable(start, length)

    def adopt(self, holder: "PagedCache", tokens: int) -> None:
        self.units = self.pool.share(holder.units[:tokens // self.pool.block_size])

    def retire(self) -> None:
        """As PoolCache.retire, less the blocks past the named prompt (output, drafts)."""
        kept = len(self.names)
        self.pool.release(self.units[kept:])
        del self.units[kept:]
        self.length = min(self.length, kept * self.pool.block_size)
        super().retire()

    def writable(self, start: int, end: int) -> None:
        """Copy each block of positions [start, end) that another cache also holds (copy on
        write)."""
        pool = self.pool
        for number in range(start // pool.block_size, -(-end // pool.block_size)):
            block = self.units[number]
            if pool.refs[block] > 1:
                fresh = pool.allocate(1)[0]
                pool.copy_block(block, fresh)
                pool.release([block])
                self.units[number] = fresh


class PagedPlan:
    """One forward's layout, write slots and gather index (host work done once)."""

    def __init__(self, segments, pool: BlockPool, windows: set, group: int, device) -> None:
        lengths = [len(s.token_ids) for s in segments]
        starts = [s.start for s in segments]
        count = len(segments)
        queries = attention.lay_out(starts, lengths, list(range(count)), count,
                                    [s.parents for s in segments])
        size = pool.block_size
        width = max(len(s.cache.units) for s in segments)
        tables = torch.zeros(count, width, dtype=torch.long)
        for row, segment in enumerate(segments):
            tables[row, :len(segment.cache.units)] = torch.tensor(segment.cache.units)
        positions = queries.write_slots
        self.write_slots = (tables[queries.row_of_token, positions // size] * size
                            + positions % size).to(device)
        key_pos = torch.arange(queries.max_len)
        ends = torch.tensor([s + n for s, n in zip(starts, lengths)])
        gather = tables[:, key_pos // size] * size + key_pos % size
        self.gather = gather.masked_fill_(key_pos[None, :] >= ends[:, None], 0).flatten() \
            .to(device)
        self.masks = attention.masks(queries, windows, group, device)
        self.queries = attention.device_of(queries, device)
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # the backend's


class PagedAttention:
    """The reference backend: gather each request's blocks, then one SDPA per layer."""

    name = "paged"

    def __init__(self, pool: BlockPool, windows: set, group: int) -> None:
        self.pool, self.windows, self.group = pool, windows, group
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # eager forwards'
        # buffers a CUDA graph reads by address (engine.graphs): used wherever they suffice,
        # never replaced
        self.fixed: tuple[torch.Tensor, torch.Tensor] | None = None

    def new_cache(self) -> PagedCache:
        return PagedCache(self.pool)

    def plan(self, segments) -> PagedPlan:
        reserve(segments)
        plan = PagedPlan(segments, self.pool, self.windows, self.group, self.pool.keys.device)
        plan.gathered = self.buffers(plan.gather.numel())
        return plan

    def buffers(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for a forward's gathered keys and values, kept from one forward to the
        next and grown as needed: a fresh multi-MB tensor per layer is fresh pages from the
        OS on a CPU, and their faults cost more than the gather itself (measured: a
        24 x 1 forward 49 against 16 ms). Grown by a quarter at least, so that contexts
        growing a token a step do not make new ones at every step; the graphs' own (`fixed`)
        wherever they suffice."""
        if self.fixed is not None and self.fixed[0].shape[0] >= slots:
            return self.fixed
        if self.gathered is None or self.gathered[0].shape[0] < slots:
            held = max((both[0].shape[0] for both in (self.gathered, self.fixed)
                        if both is not None), default=0)
            shape = (max(slots, 1024, held * 5 // 4), *self.pool.keys.shape[2:])
            self.gathered = None  # (the old ones freed before the new ones are made)
            self.gathered = tuple(self.pool.keys.new_empty(shape) for _ in range(2))
        return self.gathered

    def __call__(self, layer: int, plan: PagedPlan, q, k, v, window, scale) -> torch.Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(0, plan.write_slots, k)
        values.index_copy_(0, plan.write_slots, v)
        queries = plan.queries
        out = attention.attend(attention.pad(queries, q), self.gather(plan, keys, 0),
                               self.gather(plan, values, 1), plan.masks[window], scale)
        return attention.unpad(queries, out)

    def gather(self, plan: PagedPlan, cache: torch.Tensor, which: int) -> torch.Tensor:
        """[slots, H_kv, D] of one layer -> the batch's [B, H_kv, max_len, D]."""
        buffer = plan.gathered[which][:plan.gather.numel()]
        picked = torch.index_select(cache, 0, plan.gather, out=buffer)
        return picked.view(plan.queries.rows, plan.queries.max_len,
                           *cache.shape[1:]).transpose(1, 2)


def reserve(segments) -> None:
    """Blocks for every segment's feed before any write: a full pool fails the batch
    untouched (KVCacheFull)."""
    for segment in segments:
        segment.cache.reserve(segment.start + len(segment.token_ids), segment.start)


def blocks_for(tokens: int, sequences: int, extra_per_sequence: int,
               block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold `tokens` committed tokens over `sequences` caches, each with up to
    `extra_per_sequence` uncommitted (drafted) positions and a partly filled last block,
    plus the zero block."""
    per_sequence = -(-(extra_per_sequence + block_size - 1) // block_size) + 1
    return -(-tokens // block_size) + sequences * per_sequence + 1


def kv_pool_blocks(model, configured_tokens: int | None, max_new_per_sequence: int,
                   block_size: int = BLOCK_SIZE) -> int:
    """How many blocks the pool holds: `configured_tokens` positions when set (whole blocks,
    and the zero block: what a request drafts comes out of them too, as vLLM's
    num_gpu_blocks_override); else what the device's memory budget holds (engine.memory),
    never less than one request at the model's full context (KVBudgetTooSmall, saying how
    much is missing)."""
    if configured_tokens is not None:
        return -(-configured_tokens // block_size) + 1
    block_bytes = kv_bytes_per_token(model) * block_size
    budget = kv_budget_bytes(model)
    blocks = budget // block_bytes
    minimum = blocks_for(context_length(model), 1, max_new_per_sequence, block_size)
    if blocks < minimum:
        raise too_small(model, minimum * block_bytes, budget)
    return blocks
