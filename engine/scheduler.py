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
  session dropped; while the pool is short, retired prefixes (least recently retired first)
  and then idle sessions give theirs back: those gone quiet, then those admitted after the
  asking request, newest first (SessionStore.evictable), never a request of the batch. The
  batch's oldest requests reserve first, and its newest are refused to make room for them
  (`admitted`), as vLLM preempts its newest request.

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


def reserve_blocks(sessions: SessionStore, cache, length: int, start: int,
                   admission: tuple = ()) -> None:
    """Units in a request's cache for `length` positions, before a batch's forward: while
    the pool is short, retired prefixes and then idle sessions give theirs back, those gone
    quiet and those admitted after the request's `admission` (SessionStore.evictable: never
    one of the running batch, nor an older request's; they rebuild later, exact).

    Raises KVCacheTooSmall when the pool could never hold `length` positions, KVCacheFull
    when the batch's requests and older ones hold what it needs now (the pool answers
    RESOURCE_EXHAUSTED, the router retries), without evicting anyone when evicting every
    session it may would not be enough. A transformers cache needs nothing."""
    pool = cache.pool
    if pool is None:
        return
    if length > pool.max_tokens:
        raise KVCacheTooSmall(f"{length} positions need more KV cache than this replica "
                              f"holds ({pool.max_tokens} tokens)")
    needed = cache.missing(length, start)
    if needed > pool.free_units:  # only then are retired prefixes and sessions counted
        if not pool.frees(needed - pool.free_units, [*pool.retired.values(),
                                                     *sessions.idle_caches(admission)]):
            raise KVCacheFull(f"the KV cache needs {needed} more {pool.unit_name}, "
                              f"{pool.free_units} are free and running requests hold the rest")
        # evicting every retired prefix gives back evictable_units (a count, no walk)
        while pool.evictable_units < needed - pool.free_units and \
                sessions.evict_idle(admission):
            pass
    cache.reserve(length, start)


def admitted(entries: list, segments: list, lengths: list[int], calls: list, results: list,
             sessions: SessionStore) -> list:
    """The entries (each starts with its call's index), in their order, whose segments'
    caches could reserve units for their lengths from where they start writing
    (reserve_blocks); the others get their refusal in `results` and lose their sessions (no
    units held for a request that cannot go on).

    The oldest admitted session reserves first, and when its call cannot have its units the
    newest calls of the batch give theirs up (refused, newest first), as vLLM preempts its
    newest request: refusing the call that asked, when a batch held the pool, dropped an older
    request's cache, whose rebuild next round refused another's (SessionStore.evictable)."""
    order = [admission(sessions, calls, entry) for entry in entries]
    pending = sorted(range(len(entries)), key=order.__getitem__)
    kept = set()

    def refuse(i: int, error: Exception) -> None:
        results[entries[i][0]] = error.with_traceback(None)
        sessions.drop(calls[entries[i][0]].request_id)

    def reserve(i: int) -> None:
        """Its units, the newest pending calls refused while that makes room (KVCacheFull
        when it cannot)."""
        segment = segments[i]
        while True:
            try:
                return reserve_blocks(sessions, segment.cache, lengths[i], segment.start,
                                      order[i])
            except KVCacheFull:
                if not preempting_frees(sessions, segments, pending, segment.cache,
                                        lengths[i], segment.start, order[i]):
                    raise
                refuse(pending.pop(), KVCacheFull("the KV cache's units went to an older "
                                                  "request of the batch"))

    while pending:
        i = pending.pop(0)  # the oldest left
        try:
            reserve(i)
        except (ValueError, KVCacheFull) as error:  # KVCacheTooSmall: it never fits
            refuse(i, error)
            continue
        kept.add(i)
    return [entry for i, entry in enumerate(entries) if i in kept]


def admission(sessions: SessionStore, calls: list, entry) -> tuple:
    """The entry's request's admission (Sequence.admitted: its stamp, its id)."""
    sequence = sessions.get(calls[entry[0]].request_id)
    return () if sequence is None else sequence.admitted


def preempting_frees(sessions: SessionStore, segments: list, pending: list[int], cache,
                     length: int, start: int, admission: tuple) -> bool:
    """Whether refusing the pending calls (the newer of the batch) would give the cache its
    units for `length` positions from `start`, with what retired prefixes and idle sessions
    give: if not, nobody is refused for nothing."""
    pool = cache.pool
    if not pending or pool is None:
        return False
    caches = [*pool.retired.values(), *sessions.idle_caches(admission),
              *(segments[j].cache for j in pending)]
    return pool.frees(cache.missing(length, start) - pool.free_units, caches)
