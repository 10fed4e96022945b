"""The scheduler both pools' engines share: which calls of a batch run in one forward, how
many tokens each feeds, and which get KV memory.

- One cache feeds once per forward: a request's later calls in a batch (`in_turns`) run in
  a forward of their own after the others.
- A token budget bounds a forward (`prepare_within_budget`): calls are prepared shortest
  feed first, and a feed longer than what is left (a long prompt's prefill) is cut to it,
  at least MIN_CHUNK tokens; that call's answer is UNFINISHED, and the same call goes on from
  its cache in the next batch (chunked prefill), so a long prompt does not stall decodes.
- Admission (`admitted`) reserves each call's KV units before the forward; a call that
  cannot have them is refused alone (KVCacheFull; KVCacheTooSmall when it never could), its
  session dropped; while the pool is short, retired prefixes and then idle sessions give
  theirs back, least recently used first, never a request of the batch.

A refusal is an answer in `results`, never a raise: its traceback would keep the batch's
caches alive.
"""

from engine.cache import KVCacheFull
from engine.kv import SessionStore
from speculative.types import StaleBase

MIN_CHUNK = 16  # tokens a cut feed still gets when the budget is spent: it always advances


class KVCacheTooSmall(ValueError):
    """A request needs more KV positions than the replica's whole pool holds: it never
    fits (the pool answers OUT_OF_RANGE, the router 400)."""


def in_turns(calls: list, run) -> list:
    """run(calls) -> answers, over the calls in turns where each request appears once."""
    first, later, seen = [], [], set()
    for index, call in enumerate(calls):
        (later if call.request_id in seen else first).append(index)
        seen.add(call.request_id)
    if not later:
        return run(calls)
    results = [None] * len(calls)
    for indices in (first, later):
        for index, result in zip(indices, in_turns([calls[i] for i in indices], run)):
            results[index] = result
    return results


def prepare_within_budget(calls: list, prepare, results: list, max_tokens: int | None,
                          feed_of) -> list[tuple]:
    """(index, segment, extra) of each call prepare(call, limit) accepted, shortest feed
    (`feed_of(call)`) first, the feeds cut to what is left of `max_tokens`; a call prepare
    refuses (ValueError, StaleBase) gets its error in `results`."""
    ready, budget = [], max_tokens
    for index in sorted(range(len(calls)), key=lambda i: feed_of(calls[i])):
        limit = None if budget is None else max(budget, MIN_CHUNK)
        try:
            segment, extra = prepare(calls[index], limit)
        except (ValueError, StaleBase) as error:
            results[index] = error.with_traceback(None)
            continue
        if budget is not None:
            budget -= len(segment.token_ids)
        ready.append((index, segment, extra))
    return ready


def reserve_blocks(sessions: SessionStore, cache, length: int, start: int) -> None:
    """Units in a request's cache for `length` positions, before a batch's forward: while
    the pool is short, retired prefixes and then idle sessions give theirs back (least
    recently used first, never one of the running batch, SessionStore.batch: they rebuild
    later, exact).

    Raises KVCacheTooSmall when the pool could never hold `length` positions, KVCacheFull
    when the batch's requests hold what it needs now (the pool answers RESOURCE_EXHAUSTED,
    the router 429), without evicting anyone when evicting every idle session would not be
    enough. A transformers cache needs nothing."""
    pool = cache.pool
    if pool is None:
        return
    if length > pool.max_tokens:
        raise KVCacheTooSmall(f"{length} positions need more KV cache than this replica "
                              f"holds ({pool.max_tokens} tokens)")
    needed = cache.missing(length, start)
    if needed > pool.free_units:  # only then are retired prefixes and sessions counted
        if not pool.frees(needed - pool.free_units, [*pool.retired.values(),
                                                     *sessions.idle_caches()]):
            raise KVCacheFull(f"the KV cache needs {needed} more {pool.unit_name}, "
                              f"{pool.free_units} are free and the batch holds the rest")
        # evicting every retired prefix gives back evictable_units (a count, no walk)
        while pool.evictable_units < needed - pool.free_units and sessions.evict_idle():
            pass
    cache.reserve(length, start)


def admitted(entries: list, segments: list, lengths: list[int], calls: list, results: list,
             sessions: SessionStore) -> list:
    """The entries (each starts with its call's index) whose segments' caches could reserve
    units for their lengths from where they start writing (reserve_blocks); the others get
    their refusal in `results` and lose their sessions (no units held for a request that
    cannot go on)."""
    kept = []
    for entry, segment, length in zip(entries, segments, lengths):
        try:
            reserve_blocks(sessions, segment.cache, length, segment.start)
        except (ValueError, KVCacheFull) as error:
            results[entry[0]] = error.with_traceback(None)
            sessions.drop(calls[entry[0]].request_id)
            continue
        kept.append(entry)
    return kept
