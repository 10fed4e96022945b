"""The model-free drafters the router runs itself (n-gram prompt lookup, suffix decoding),
kept off its event loop where their work is long.

Their work is Python over the request's tokens: a suffix drafter indexes a whole prompt on a
request's first call (about 170 us a token: 2.4 s for 16k tokens), and its release indexes
the output for every later request; prompt lookup converts the whole context on a first call
(its search each round is C: drafter.ngram). On the
event loop that stalls every stream of the replica. A call that brings more than
OFF_LOOP_NEW_TOKENS new tokens (a first call, a rebuild) or a context over OFF_LOOP_TOKENS,
and every release, runs on a worker thread instead (the loop then runs between the
interpreter's switches); one lock per drafter keeps its state to one caller at a time."""

import asyncio

from speculative.types import ProposeCall, timed

# below these a call is cheaper inline than a hop to a thread (about 0.1 ms): a round's few
# new tokens over a short context
OFF_LOOP_NEW_TOKENS, OFF_LOOP_TOKENS = 64, 1024


class OffLoop:
    def __init__(self, drafter) -> None:
        self.drafter, self.lock = drafter, asyncio.Lock()

    async def propose(self, call: ProposeCall):
        new = len(call.sync.new_token_ids) + len(call.assumed_token_ids)
        async with self.lock:
            if new <= OFF_LOOP_NEW_TOKENS and call.sync.committed_len + new <= OFF_LOOP_TOKENS:
                return timed(self.drafter.propose_now, call)
            return await asyncio.to_thread(timed, self.drafter.propose_now, call)

    async def release(self, request_id: str) -> None:
        async with self.lock:
            await asyncio.to_thread(self.drafter.release_now, request_id)
