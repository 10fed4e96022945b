"""Per-request token state and KV caches, kept in the replica that holds the model.

A cache is a pool's (engine.cache: positions in the replica's KV pool, rolled back by a length
reset) when the model runs the lean forward, else a transformers DynamicCache
(engine.runner.TransformersCache); what follows about sliding windows concerns the latter (a
pool's cache keeps every position). A new request's cache starts from the longest prompt
prefix the pool holds in full blocks (prefix caching, engine.cache); `cached_tokens` counts it.

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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.batch import Segment
from engine.cache import salted_root
from speculative.prefixes import GrowingPrefixHash, common_prefix_len
from speculative.shaping import Counted, SeenTokens
from speculative.tree import main_chain_length
from speculative.types import PrefixSync, StaleBase


NO_TOKEN = -1  # a cached slot whose keys stand for no token at that position (a tree node)
# a session idle this long is taken for a request gone quiet, not one between two rounds
# (SessionStore.evict_idle): a round lasts well under a second, a busy pool's retries seconds
STALE_S = 30.0


class Sequence:
    """One request in one model: committed ids, and the ids whose keys/values are cached."""

    def __init__(self) -> None:
        self.committed: list[int] = []
        self._hasher = GrowingPrefixHash()  # the committed prefix's fingerprint, as of apply
        self.cached_ids: list[int] = []
        self.cache = None  # the runner's (engine.runner.ModelRunner.new_cache)
        self.cached_tokens = 0  # prompt tokens its cache started with (a prefix hit)
        self.root = 0  # its cache's block chain's first name (its cache_salt's: salted_root)
        self.last_used = 0.0  # time.monotonic() of its last call (the store's TTL)
        self.admitted = ()  # (the request's admission stamp, its id): evictable's order
        self.unfinished = None  # the call whose feed was cut (chunked prefill), to resume
        self.constraint = None  # a structured output's matcher (speculative.grammar)
        # what a drafter without a model keeps per request (drafter.suffix.RequestIndex,
        # drafter.ngram.TokenBytes): dropped on a full-prefix rebuild, closed with the session
        self.drafter_state = None
        self.seen: SeenTokens | None = None  # what penalties count of committed (counted)

    def check(self, sync: PrefixSync) -> None:
        """Raise StaleBase unless the call builds on this committed prefix (or rebuilds)."""
        if sync.known_len != 0 and (sync.known_len != len(self.committed)
                                    or sync.known_hash != self.committed_hash):
            raise StaleBase(
                f"holds {len(self.committed)} committed tokens, call builds on {sync.known_len}"
            )

    def apply(self, sync: PrefixSync) -> None:
        """Advance to the committed prefix the call names (SessionStore.apply has checked
        that it builds on this one: check)."""
        if sync.known_len == 0:
            self.committed = []  # a full prefix: rebuild; the cache keeps what still matches
            self._hasher = GrowingPrefixHash()
            self.drafter_state = self.seen = None
        self.committed.extend(sync.new_token_ids)
        self._hasher.of(self.committed)
        self.publish()

    @property
    def committed_hash(self) -> int:
        return self._hasher.value

    def counted(self, prompt_len: int, with_prompt: bool) -> Counted:
        """The committed prefix as a penalised request's calls count it (its first prompt_len
        tokens only when with_prompt: a repetition penalty), grown as it is committed."""
        seen = self.seen
        if seen is None or (seen.prompt_len, seen.with_prompt) != (prompt_len, with_prompt):
            seen = self.seen = SeenTokens(prompt_len, with_prompt)
        return seen.of(self.committed)

    def publish(self) -> None:
        """Offer the full blocks of the committed prefix its cache holds to later requests."""
        cache = self.cache
        if cache is None or cache.pool is None:
            return
        size = cache.pool.block_size
        end = len(cache.names) * size
        limit = min(len(self.committed), cache.length)
        # only blocks whose positions hold the committed tokens (not drafts fed there)
        while end + size <= limit and \
                self.cached_ids[end:end + size] == self.committed[end:end + size]:
            end += size
        if end > len(cache.names) * size:
            cache.publish(self.committed[:end])

    def close(self) -> None:
        """The request is gone: its cache is kept for its prefix while memory allows."""
        if self.drafter_state is not None:
            self.drafter_state.close(self.committed)
            self.drafter_state = None
        if self.cache is not None:
            self.publish()
            self.cache.retire()
            self.cache = None

    def feed(self, runner, extra: list[int], num_logits: int) -> torch.Tensor:
        """Bring the cache to committed + extra; returns the logits of its last `num_logits`
        positions, [num_logits, V]."""
        return runner.forward([self.segment(runner, extra, num_logits)])[0]

    def segment(self, runner, extra: list[int], num_logits: int,
                limit: int | None = None, parents: tuple[int, ...] | None = None) -> Segment:
        """What to feed to bring the cache to committed + extra, as one part of a batch.

        The cache is cropped to the longest prefix it shares with committed + extra, but never
        past the first position whose logits are asked for, so those are always recomputed.
        A feed longer than `limit` (a long prompt's prefill) gives at most its first `limit`
        tokens and no logits: a chunk, cut before the positions whose logits are asked for
        (those are always fed together), so every chunk advances; the next segment goes on
        from there. `parents`: extra's last tokens are a draft tree (engine.attention);
        its nodes' slots are marked as holding no token of the sequence, all but a first run
        that is a chain from the root, whose keys stand where the tokens will if accepted.
        """
        ids = self.committed + extra
        if self.cache is None:  # a new request: from the longest cached prefix
            self.cache = runner.new_cache()
            self.cache.root = self.root
            self.cached_tokens = self.cache.adopt_prefix(ids, len(ids) - max(num_logits, 1))
            self.cached_ids = ids[:self.cached_tokens]
        start = min(common_prefix_len(self.cached_ids, ids), len(ids) - num_logits)
        if limit is not None and len(ids) - start > limit:
            end = min(start + limit, len(ids) - num_logits)
            if end > start:
                return self.prepare(runner, ids[start:end], start, 0)
        segment = self.prepare(runner, ids[start:], start, num_logits)
        if parents:
            segment.parents = tuple(parents)
            in_place = main_chain_length(parents)
            self.cached_ids[len(ids) - len(parents) + in_place:] = \
                [NO_TOKEN] * (len(parents) - in_place)
        return segment

    def next_segment(self, runner, token: int) -> Segment:
        """What segment() gives for one token after everything the cache holds, its logits
        asked, without comparing the whole sequence with the cache: a draft's next step,
        whose previous step fed the sequence up to the token before."""
        return self.prepare(runner, [token], len(self.cached_ids), 1)

    def prepare(self, runner, token_ids: list[int], start: int, num_logits: int) -> Segment:
        """Crop the cache to `start` tokens; the segment feeds token_ids after it."""
        if self.cache is not None and self.cache.get_seq_length() > 0:
            remove = max(0, self.cache.get_seq_length() - start)
            if self.cache.can_roll_back(remove):
                self.cache.crop(-remove)  # 0 still trims sliding layers back to their window
            else:
                self.cache.free()
                self.cache = None
        if self.cache is None:
            self.cache = runner.new_cache()
            token_ids, start = self.cached_ids[:start] + token_ids, 0
        del self.cached_ids[start:]
        self.cached_ids.extend(token_ids)
        return Segment(self.cache, token_ids, start, num_logits)


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
        self.serving: frozenset[str] = frozenset()  # the requests of the batch being run

    @contextmanager
    def batch(self, request_ids):
        """While a batch of these requests is prepared and run, none of them is evicted (a
        prepared segment writes into its cache)."""
        self.serving = frozenset(request_ids)
        try:
            yield
        finally:
            self.serving = frozenset()

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

    def apply(self, request_id: str, sync: PrefixSync, cache_salt: str = "") -> Sequence:
        """The request's sequence advanced to `sync`; raises StaleBase when it cannot be, and
        ValueError for an empty prefix, before any session is made or evicted. cache_salt:
        the request's (vLLM's), which its prompt blocks are named under (salted_root)."""
        if sync.known_len == 0 and not sync.new_token_ids:
            raise ValueError("the committed prefix is empty: a prompt needs at least one token")
        sequence = self._sequences.get(request_id)
        if sequence is None:
            if sync.known_len != 0:
                self.stats.misses += 1
                raise StaleBase(f"request {request_id!r} is not cached here")
            sequence = Sequence()
            sequence.root = salted_root(cache_salt)
            # the router's stamp, which a rebuild carries again (evictable's order)
            sequence.admitted = (sync.admitted_at or time.time(), request_id)
            self._sequences[request_id] = sequence
        else:
            self.stats.hits += 1
            try:
                sequence.check(sync)
            except StaleBase:
                self.stats.misses += 1
                raise
            self._sequences.move_to_end(request_id)
        sequence.last_used = time.monotonic()
        # what the session grows by (a rebuild replaces what it held)
        self._make_room(sync.known_len + len(sync.new_token_ids) - len(sequence.committed))
        sequence.apply(sync)
        return sequence

    def get(self, request_id: str) -> "Sequence | None":
        """The request's sequence, if held (no use recorded: not a call)."""
        return self._sequences.get(request_id)

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
        newest, nor one of the batch being run) until both bounds hold, or none is left to
        evict."""
        limit = self.max_tokens
        tokens = self.tokens + incoming if limit is not None else 0  # summed once
        if len(self._sequences) <= self.capacity and (limit is None or tokens <= limit):
            return  # the usual call: nothing to evict, no walk over the sessions
        for request_id in list(self._sequences)[:-1]:
            if not (len(self._sequences) > self.capacity or limit is not None and tokens > limit):
                return
            if request_id in self.serving:
                continue
            evicted = self._sequences.pop(request_id)
            evicted.close()
            tokens -= len(evicted.committed)
            self.stats.evictions += 1

    def may_close(self, request_id: str, incoming: int) -> bool:
        """Whether a call of the request that adds up to `incoming` committed tokens may
        close sessions (a sweep due, or an eviction to keep the bounds): closing can cost
        (a suffix drafter indexes the closed session's output)."""
        sequences = self._sequences
        if self._expired(time.monotonic()):
            return True
        if request_id not in sequences and len(sequences) >= self.capacity:
            return True
        return self.max_tokens is not None and self.tokens + incoming > self.max_tokens

    def sweep(self) -> int:
        """Drop sessions idle longer than ttl_s (a release that never came); how many."""
        now, dropped = time.monotonic(), 0
        while self._expired(now):
            self._sequences.popitem(last=False)[1].close()
            dropped += 1
        return dropped

    def _expired(self, now: float) -> bool:
        """Whether the least recently used session has idled past ttl_s (sweep's next)."""
        return self.ttl_s is not None and bool(self._sequences) and \
            next(iter(self._sequences.values())).last_used <= now - self.ttl_s

    def release(self, request_id: str) -> None:
        """Forget the request; its cache's units are kept for its prefix until needed."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            sequence.close()

    def drop(self, request_id: str) -> None:
        """Forget the request and free its cache's units now (a refused or failed call)."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None and sequence.cache is not None:
            sequence.cache.free()

    def clear(self) -> None:
        for request_id in list(self._sequences):
            self.drop(request_id)

    def evictable(self, newer_than: tuple = ()) -> list:
        """(request id, sequence) of the sessions outside the running batch that a call of
        the request admitted `newer_than` may take units from, in the order they go: those
        idle past STALE_S first (least recently used: requests gone quiet), then those
        admitted after it, newest first, as vLLM preempts its newest request and lets a new
        one wait. Least recently used first, a pool too small for its running requests
        evicts one between two rounds, whose rebuild evicts the next (measured in
        docs/engine.md, KV pools)."""
        quiet = time.monotonic() - STALE_S
        idle = [(request_id, sequence) for request_id, sequence in self._sequences.items()
                if request_id not in self.serving]
        newer = [pair for pair in idle
                 if pair[1].last_used > quiet and pair[1].admitted > newer_than]
        return [pair for pair in idle if pair[1].last_used <= quiet] + sorted(
            newer, key=lambda pair: pair[1].admitted, reverse=True)

    def idle_caches(self, newer_than: tuple = ()) -> list:
        """The pool caches of the sessions a call of the request admitted `newer_than` may
        take units from (evictable: what evict_idle could give back, with the retired caches
        that share their units: UnitPool.frees)."""
        return [sequence.cache for _, sequence in self.evictable(newer_than)
                if sequence.cache is not None and sequence.cache.pool is not None]

    def evict_idle(self, newer_than: tuple = ()) -> bool:
        """Release the first of evictable(newer_than); False when there is none."""
        for request_id, _ in self.evictable(newer_than)[:1]:
            self.release(request_id)
            self.stats.evictions += 1
            return True
        return False


class PoolEngine(Protocol):
    """What a pool replica asks of its engine (deployments.pools) beside its batch function
    (`score_batch` or `propose_batch`): the requests it holds, as a SessionStore (release,
    sweep, membership, ids, count), and with a model its `runner` (engine.runner), whose KV
    pool kv_usage reads. The verifier, the model drafter and the n-gram drafter are
    PoolEngines."""

    sessions: SessionStore


def kv_usage(engine: PoolEngine) -> float:
    """The share of the engine's KV pool its sessions hold (engine.cache.UnitPool.usage); 0
    without a pool: a drafter without a model, or transformers' caches (each request's own)."""
    runner = getattr(engine, "runner", None)
    pool = None if runner is None else runner.pool
    return 0.0 if pool is None else pool.usage
