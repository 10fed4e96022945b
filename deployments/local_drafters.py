"""The model-free drafters the router runs itself (n-gram prompt lookup, suffix decoding),
kept off its event loop where their work is long.

Their work is Python over the request's tokens: a suffix drafter indexes a whole prompt on a
request's first call (about 170 us a token: 2.4 s for 16k tokens), and its release indexes
the output for every later request; prompt lookup converts the whole context on a first call
(its search each round is C: drafter.ngram). On the
event loop that stalls every stream of the replica. A call that brings more than
OFF_LOOP_NEW_TOKENS new tokens (a first call, a rebuild) or a context over OFF_LOOP_TOKENS,
every call with a grammar, one that may close other sessions (an eviction: a suffix drafter
indexes each closed output, as a release does; the pools ask the same, deployments.pools),
and every release, runs on a worker thread instead (the loop then
runs between the interpreter's switches); one lock per drafter keeps its state to one caller
at a time."""

import asyncio

from drafter.registry import DrafterSpec, build_drafter, router_side_kinds
from speculative.types import ProposeCall, timed

# below these a call is cheaper inline than a hop to a thread (about 0.1 ms): a round's few
# new tokens over a short context
OFF_LOOP_NEW_TOKENS, OFF_LOOP_TOKENS = 64, 1024


class OffLoop:
    def __init__(self, drafter) -> None:
        self.drafter, self.lock = drafter, asyncio.Lock()
        self.observed: dict[str, list[int]] = {}  # a request's committed tokens at its end
        self.releasing: set[asyncio.Task] = set()

    async def propose(self, call: ProposeCall):
        new = len(call.sync.new_token_ids) + len(call.assumed_token_ids)
        # a call with a grammar may build the request's matcher, at the first round with a
        # proposal (a 60 KB schema over the demo's 4,096 tokens: 41 ms the loop stood still)
        if new <= OFF_LOOP_NEW_TOKENS and call.sync.committed_len + new <= OFF_LOOP_TOKENS \
                and call.sampling.grammar is None:
            async with self.lock:  # the sessions read under it: none come or go meanwhile
                if not self.drafter.sessions.may_close(call.request_id, new):
                    return timed(self.drafter.propose_now, call)
        return await self.on_thread(timed, self.drafter.propose_now, call)

    def observe(self, request_id: str, token_ids: list[int]) -> None:
        """types.Drafter's: handed to the drafter with the release, under the lock."""
        if hasattr(self.drafter, "observe"):
            self.observed[request_id] = token_ids

    async def release(self, request_id: str) -> None:
        """Runs to its end even when its caller is cancelled meanwhile: the choices of a
        request whose client went away are cancelled, then cancelled again while their
        releases wait for the lock (choices.all_or_none, once the first has ended), which
        left their sessions in the drafter and their outputs out of its index."""
        task = asyncio.ensure_future(self.on_thread(self.release_now, request_id,
                                                    self.observed.pop(request_id, None)))
        self.releasing.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self.releasing.discard)
        await asyncio.shield(task)

    def release_now(self, request_id: str, observed: list[int] | None) -> None:
        if observed is not None:
            self.drafter.observe(request_id, observed)
        self.drafter.release_now(request_id)

    async def on_thread(self, work, *args):
        """work(*args) on a worker thread, holding the lock until the work ends, even when
        the caller is cancelled meanwhile (the thread runs on: a release after it must not
        overtake it, and no other call may share the drafter with it)."""
        await self.lock.acquire()
        try:
            done = asyncio.ensure_future(asyncio.to_thread(work, *args))
        except BaseException:
            self.lock.release()
            raise
        done.add_done_callback(self.after_thread)
        return await asyncio.shield(done)

    def after_thread(self, done: asyncio.Future) -> None:
        self.lock.release()
        if not done.cancelled():
            done.exception()  # retrieved: a cancelled caller's refusal is nobody's to raise


def local_drafters(model: str, target, max_running_requests: int,
                   max_cached_tokens: int) -> dict[str, OffLoop]:
    """The drafters without a model that the router runs itself, by kind, each with sessions
    for every choice the router runs and as many finished ones (the drafters' default 256,
    below a larger admission, evicted running sessions every round: a suffix drafter then
    indexed each whole prompt again), and at most max_cached_tokens committed tokens in
    them (a few long contexts held gigabytes of suffix tries)."""
    sessions = max(256, 2 * max_running_requests)
    return {kind: OffLoop(build_drafter(DrafterSpec(kind=kind, target=model,
                                                    max_cached_requests=sessions,
                                                    max_cached_tokens=max_cached_tokens),
                                        target))
            for kind in router_side_kinds()}
