"""The CPU default attention backend: each request's keys in one region, read in place.

Memory: `RegionPool` holds every layer's keys and values as [layers, regions, kv_heads,
region_tokens, head_dim]: a request's cache is one region (the lowest free one, so the
requests in flight sit side by side), each head's positions contiguous in it. A batch's keys
are then views of the pool, with no gather: the requests of a batch occupy a few runs of
neighbouring regions, and each run is one SDPA call over `keys[layer, lo:hi, :, :max_len]`
(regions in a run that are not in the batch get a padding query that reads key 0; a gap of
more than MAX_GAP regions starts a new run). The bytes a batch reads are its keys and values
once, against three times for the gather (engine.paged: read, write, read).

The pool is allocated empty: on a CPU its pages are backed only as positions are written
(each region's high-water mark is zeroed ahead of the first read, and again from the start
when the region is handed out, so a masked read never meets uninitialised memory nor what
its last owner wrote). A region holds the model's whole context, so the pool is sized in
regions from the memory budget (engine.memory) counting every region in full. A prefix
hit copies the holder's positions into the new region (contiguity rules out sharing).
"""

import torch

from engine import attention
from engine.cache import BLOCK_SIZE, PoolCache, UnitPool
from engine.memory import context_length, kv_budget_bytes, kv_bytes_per_token, too_small

MAX_GAP = 2  # regions between two of a batch that one SDPA call still reads across
# positions a region is zeroed ahead of its reads: a decoding request's region is zeroed once
# every ZERO_AHEAD steps, not at every step (two small writes per region in the batch)
ZERO_AHEAD = 64


class RegionPool(UnitPool):
    unit_name = "regions"

    def __init__(self, num_layers: int, regions: int, kv_heads: int, region_tokens: int,
                 head_dim: int, dtype, device, block_size: int = BLOCK_SIZE) -> None:
        super().__init__(regions, block_size)
        shape = (num_layers, regions, kv_heads, region_tokens, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.written = [0] * regions  # positions zeroed or written, from the start
        self.max_tokens = region_tokens

    def allocate(self, count: int) -> list[int]:
        """As UnitPool's, each region handed out zeroed again as its new owner reaches it: a
        row reads its region up to the batch's longest request, masked, and SDPA's masked
        weight times a NaN or inf value the last owner left there (an overflowed float16
        forward) is NaN: the request's logits would follow its batch-mates and who held the
        region before."""
        units = super().allocate(count)
        for unit in units:
            self.written[unit] = 0
        return units

    def initialise(self, regions: list[int], length: int) -> None:
        """Zero the positions below `length` of these regions not written since they were
        handed out (allocate), and up to ZERO_AHEAD past it. Keys and values are written only
        below a region's mark (a plan initialises its batch's end before the batch writes),
        so zeroing ahead meets none."""
        for region in regions:
            if self.written[region] < length:
                start, end = self.written[region], min(length + ZERO_AHEAD, self.max_tokens)
                self.keys[:, region, :, start:end].zero_()
                self.values[:, region, :, start:end].zero_()
                self.written[region] = end


class RegionCache(PoolCache):
    @property
    def region(self) -> int:
        return self.units[0]

    def missing(self, length: int, start: int | None = None) -> int:
        return 0 if self.units else 1

    def reserve(self, length: int, start: int | None = None) -> None:
        if not self.units:
            self.units = self.pool.allocate(1)

    def adopt(self, holder: "RegionCache", tokens: int) -> None:
        """Copy the holder's first `tokens` positions into a region of its own (the holder,
        if retired, is not evictable meanwhile; KVCacheFull when no region is free)."""
        pool = self.pool
        retired = pool.reclaim(holder)
        try:
            self.reserve(tokens)
        finally:
            if retired:
                pool.retire(holder)
        source, target = holder.region, self.region
        pool.initialise([target], tokens)
        pool.keys[:, target, :, :tokens] = pool.keys[:, source, :, :tokens]
        pool.values[:, target, :, :tokens] = pool.values[:, source, :, :tokens]


def runs(regions: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) runs covering the sorted distinct regions, split at gaps over MAX_GAP."""
    out, lo, last = [], regions[0], regions[0]
    for region in regions[1:]:
        if region - last - 1 > MAX_GAP:
            out.append((lo, last + 1))
            lo = region
        last = region
    out.append((lo, last + 1))
    return out


class RegionPlan:
    def __init__(self, segments, pool: RegionPool, windows: set, group: int, device) -> None:
        regions = [s.cache.region for s in segments]
        self.runs = runs(sorted(regions))
        first_row, rows = {}, 0
        for lo, hi in self.runs:
            first_row[lo], rows = rows, rows + hi - lo
        row_of = [next(first_row[lo] + r - lo for lo, hi in self.runs if lo <= r < hi)
                  for r in regions]
        lengths = [len(s.token_ids) for s in segments]
        queries = attention.lay_out([s.start for s in segments], lengths, row_of, rows,
                                    [s.parents for s in segments])
        pool.initialise([r for lo, hi in self.runs for r in range(lo, hi)], queries.max_len)
        kv_heads, span = pool.keys.shape[2], pool.keys.shape[3]
        region_of_token = torch.repeat_interleave(torch.tensor(regions), torch.tensor(lengths))
        slot = (region_of_token[:, None] * kv_heads + torch.arange(kv_heads)) * span \
            + queries.write_slots[:, None]
        self.write_rows = slot.flatten().to(device)  # [N * H_kv] rows of [.., D]
        self.masks = attention.masks(queries, windows, group, device)
        self.row_ranges = [(first_row[lo], first_row[lo] + hi - lo) for lo, hi in self.runs]
        self.queries = attention.device_of(queries, device)


class RegionAttention:
    name = "regions"

    def __init__(self, pool: RegionPool, windows: set, group: int) -> None:
        self.pool, self.windows, self.group = pool, windows, group

    def new_cache(self) -> RegionCache:
        return RegionCache(self.pool)

    def plan(self, segments) -> RegionPlan:
        for segment in segments:
            segment.cache.reserve(segment.start + len(segment.token_ids))
        return RegionPlan(segments, self.pool, self.windows, self.group, self.pool.keys.device)

    def __call__(self, layer: int, plan: RegionPlan, q, k, v, window, scale) -> torch.Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        dim = keys.shape[-1]
        keys.view(-1, dim).index_copy_(0, plan.write_rows, k.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, plan.write_rows, v.reshape(-1, dim))
        queries, mask = plan.queries, plan.masks[window]
        padded = attention.pad(queries, q)
        length = queries.max_len
        parts = [attention.attend(padded[first:last], keys[lo:hi, :, :length],
                                  values[lo:hi, :, :length],
                                  None if mask is None else mask[first:last], scale)
                 for (lo, hi), (first, last) in zip(plan.runs, plan.row_ranges)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attention.unpad(queries, out)


def region_count(model, configured_tokens: int | None, max_sequences: int) -> int:
    """Regions of the model's whole context the pool holds: for `configured_tokens` when set,
    else what the memory budget holds (at most two per session: retired prefixes), never
    fewer than two (KVBudgetTooSmall)."""
    span = context_length(model)
    if configured_tokens is not None:
        return -(-configured_tokens // span) + 1
    region_bytes = span * kv_bytes_per_token(model)
    budget = kv_budget_bytes(model)
    regions = min(budget // region_bytes, 2 * max_sequences + 1)
    if regions < 2:
        raise too_small(model, 2 * region_bytes, budget)
    return regions
