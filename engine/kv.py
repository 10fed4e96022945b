"""Per-request token state and KV caches, kept in the replica that holds the model.

A cache is a paged one (engine.paged: a block table in the replica's block pool, rolled back
by a length reset) when the model runs the lean forward, else a transformers DynamicCache;
what follows about sliding windows concerns the latter (a paged cache keeps every position).

A pool keeps one `Sequence` per request in a bounded LRU (`SessionStore`). Each call names the
committed prefix it builds on (`PrefixSync`); the sequence checks that base, appends the newly
committed tokens, and crops its transformers `DynamicCache` to the longest prefix it shares with
what must be fed next, so rejected draft tokens never reach a later distribution.

Sliding-window layers (Mistral, Gemma-2) keep only the last window - 1 positions, so a rollback
once a layer has passed its window needs the positions it dropped. The cache records the past
(`activate_past_recording`): a layer keeps everything fed since the last crop, and every call
crops (possibly by 0 tokens) before it feeds, which trims it back to the window. A rollback
therefore reaches back as far as the previous call fed, which covers the rejected drafts; a
deeper one (a rebuild that keeps part of a cache) re-prefills instead. Exact either way.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from engine.batch import LEAN, Segment, forward_packed
from engine.paged import KVCacheFull, PagedCache
from speculative.types import EMPTY_PREFIX_HASH, PrefixSync, StaleBase, prefix_hash


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Sequence:
    """One request in one model: committed ids, and the ids whose keys/values are cached."""

    def __init__(self) -> None:
        self.committed: list[int] = []
        self.committed_hash = EMPTY_PREFIX_HASH
        self.cached_ids: list[int] = []
        self.cache: DynamicCache | None = None
        self.last_used = 0.0  # time.monotonic() of its last call (the store's TTL)
        self.unfinished = None  # the call whose feed was cut (chunked prefill), to resume
        self.constraint = None  # a structured output's matcher (speculative.grammar)

    def apply(self, sync: PrefixSync) -> None:
        """Advance to the committed prefix the call names, or raise StaleBase."""
        if sync.known_len == 0:
            self.committed = []  # a full prefix: rebuild; the cache keeps what still matches
            self.committed_hash = EMPTY_PREFIX_HASH
        elif sync.known_len != len(self.committed) or sync.known_hash != self.committed_hash:
            raise StaleBase(
                f"holds {len(self.committed)} committed tokens, call builds on {sync.known_len}"
            )
        self.committed.extend(sync.new_token_ids)
        self.committed_hash = prefix_hash(self.committed)
        if not self.committed:
            raise ValueError("the committed prefix is empty: a prompt needs at least one token")

    def feed(self, model, extra: list[int], num_logits: int) -> torch.Tensor:
        """Bring the cache to committed + extra; returns the logits of its last `num_logits`
        positions, [num_logits, V]."""
        return forward_packed(model, [self.segment(model, extra, num_logits)])[0]

    def segment(self, model, extra: list[int], num_logits: int,
                limit: int | None = None) -> Segment:
        """What to feed to bring the cache to committed + extra, as one part of a batch.

        The cache is cropped to the longest prefix it shares with committed + extra, but never
        past the first position whose logits are asked for, so those are always recomputed.
        A feed longer than `limit` (a long prompt's prefill) gives at most its first `limit`
        tokens and no logits: a chunk, cut before the positions whose logits are asked for
        (those are always fed together), so every chunk advances; the next segment goes on
        from there.
        """
        ids = self.committed + extra
        start = min(common_prefix_len(self.cached_ids, ids), len(ids) - num_logits)
        if limit is not None and len(ids) - start > limit:
            end = min(start + limit, len(ids) - num_logits)
            if end > start:
                return self.prepare(model, ids[start:end], start, 0)
        return self.prepare(model, ids[start:], start, num_logits)

    def prepare(self, model, token_ids: list[int], start: int, num_logits: int) -> Segment:
        """Crop the cache to `start` tokens; the segment feeds token_ids after it."""
        if self.cache is not None:
            remove = max(0, self.cache.get_seq_length() - start)
            if can_roll_back(self.cache, remove):
                self.cache.crop(-remove)  # 0 still trims sliding layers back to their window
            else:
                self.cache = None
        if self.cache is None:
            self.cache = new_cache(model)
            token_ids, start = self.cached_ids[:start] + token_ids, 0
        del self.cached_ids[start:]
        self.cached_ids.extend(token_ids)
        return Segment(self.cache, token_ids, start, num_logits)


def new_cache(model):
    """A paged cache in the model's block pool when it runs the lean forward, else a
    DynamicCache."""
    lean = getattr(model, LEAN, None)
    if lean is not None:
        return lean.new_cache()
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # sliding layers keep what a rollback needs (see above)
    return cache


def can_roll_back(cache, num_tokens: int) -> bool:
    """Whether every layer still holds what it needs after removing num_tokens: a sliding
    layer must keep min(window - 1, its new length) positions (a paged cache keeps all)."""
    if isinstance(cache, PagedCache):
        return True
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and layer.is_initialized:
            kept = layer.keys.shape[-2] - num_tokens
            if kept < min(layer.sliding_window - 1, layer.cumulative_length - num_tokens):
                return False
    return True


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0  # calls whose base was not here (evicted, moved, unknown): rebuilt
    evictions: int = 0


class SessionStore:
    """Per-request sequences, least recently used first out: bounded in sessions and in
    committed tokens (what their caches hold, near enough), and swept of sessions idle
    longer than ttl_s. An evicted request's next call answers REBUILD: slower, exact."""

    def __init__(self, capacity: int, max_tokens: int | None = None,
                 ttl_s: float | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.max_tokens, self.ttl_s = capacity, max_tokens, ttl_s
        self.stats = StoreStats()
        self._sequences: OrderedDict[str, Sequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sequences)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sequences

    def __iter__(self):
        """The request ids held, least recently used first."""
        return iter(list(self._sequences))

    @property
    def tokens(self) -> int:
        return sum(len(s.committed) for s in self._sequences.values())

    def apply(self, request_id: str, sync: PrefixSync) -> Sequence:
        """The request's sequence advanced to `sync`; raises StaleBase when it cannot be."""
        sequence = self._sequences.get(request_id)
        if sequence is None:
            if sync.known_len != 0:
                self.stats.misses += 1
                raise StaleBase(f"request {request_id!r} is not cached here")
            sequence = Sequence()
            self._sequences[request_id] = sequence
        else:
            self.stats.hits += 1
            self._sequences.move_to_end(request_id)
        sequence.last_used = time.monotonic()
        self._make_room(len(sync.new_token_ids))
        try:
            sequence.apply(sync)
        except StaleBase:
            self.stats.misses += 1
            raise
        return sequence

    def resume(self, request_id: str, call) -> "Sequence | None":
        """The request's sequence when `call` is the one whose feed was cut (it is already
        synced: chunked prefill goes on), else None."""
        sequence = self._sequences.get(request_id)
        if sequence is None or sequence.unfinished is not call:
            return None
        self._sequences.move_to_end(request_id)
        sequence.last_used = time.monotonic()
        return sequence

    def _make_room(self, incoming: int) -> None:
        """Evict from the least recently used end (never the session just synced, the
        newest) until both bounds hold."""
        limit = self.max_tokens
        tokens = self.tokens + incoming if limit is not None else 0  # summed once
        while len(self._sequences) > 1 and (len(self._sequences) > self.capacity
                                            or limit is not None and tokens > limit):
            _, evicted = self._sequences.popitem(last=False)
            tokens -= len(evicted.committed)
            self.stats.evictions += 1

    def sweep(self) -> int:
        """Drop sessions idle longer than ttl_s (a release that never came); how many."""
        if self.ttl_s is None:
            return 0
        expired = time.monotonic() - self.ttl_s
        dropped = 0
        while self._sequences and next(iter(self._sequences.values())).last_used <= expired:
            self._sequences.popitem(last=False)
            dropped += 1
        return dropped

    def release(self, request_id: str) -> None:
        """Forget the request; a paged cache gives its blocks back at once."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None and isinstance(sequence.cache, PagedCache):
            sequence.cache.free()

    def evictable_blocks(self, keep: set[str]) -> int:
        """Paged blocks held by sessions not in `keep` (what evict_idle could give back)."""
        return sum(len(sequence.cache.blocks) for request_id, sequence in self._sequences.items()
                   if request_id not in keep and isinstance(sequence.cache, PagedCache))

    def evict_idle(self, keep: set[str]) -> bool:
        """Release the least recently used session not in `keep`; False when there is none."""
        for request_id in self._sequences:
            if request_id not in keep:
                self.release(request_id)
                self.stats.evictions += 1
                return True
        return False


class KVCacheTooSmall(ValueError):
    """A request needs more KV positions than the replica's whole pool holds: it never
    fits (the pool answers OUT_OF_RANGE, the router 400)."""


def reserve_blocks(sessions: SessionStore, cache, length: int, keep: set[str]) -> None:
    """Blocks in a request's paged cache for `length` positions, before a batch's forward:
    while the pool is short, idle sessions give theirs back (least recently used first,
    never one of the batch, `keep`: they rebuild later, exact).

    Raises KVCacheTooSmall when the pool could never hold `length` positions, KVCacheFull
    when the batch's requests hold what it needs now (the pool answers RESOURCE_EXHAUSTED,
    the router 429), without evicting anyone when evicting every idle session would not be
    enough. A transformers cache needs nothing."""
    if not isinstance(cache, PagedCache):
        return
    pool = cache.pool
    if length > (pool.num_blocks - 1) * pool.block_size:
        raise KVCacheTooSmall(f"{length} positions need more KV cache than this replica "
                              f"holds ({(pool.num_blocks - 1) * pool.block_size} tokens)")
    needed = cache.missing_blocks(length)
    if needed > pool.free_blocks:  # only then are the idle sessions counted
        if needed > pool.free_blocks + sessions.evictable_blocks(keep):
            raise KVCacheFull(f"the KV cache needs {needed} more blocks of {pool.block_size} "
                              f"tokens, {pool.free_blocks} are free and the batch holds the "
                              f"rest")
        while pool.free_blocks < needed:
            sessions.evict_idle(keep)
    cache.reserve(length)


def admitted(entries: list, caches: list, lengths: list[int], calls: list, results: list,
             sessions: SessionStore) -> list:
    """The entries (each starts with its call's index) whose caches could reserve blocks for
    their lengths (reserve_blocks); the others get their refusal in `results` and lose their
    sessions (no blocks held for a request that cannot go on)."""
    keep = {calls[entry[0]].request_id for entry in entries}
    kept = []
    for entry, cache, length in zip(entries, caches, lengths):
        try:
            reserve_blocks(sessions, cache, length, keep)
        except (ValueError, KVCacheFull) as error:
            # an answer, not a raise: its traceback would keep the batch's caches alive
            results[entry[0]] = error.with_traceback(None)
            sessions.release(calls[entry[0]].request_id)
            continue
        kept.append(entry)
    return kept
