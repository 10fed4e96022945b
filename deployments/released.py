"""The requests a pool replica released lately, for a call of theirs that comes after its
Release: a request's first call on the router's stream to a replica can be overtaken by the
request's Release (another rpc; the call's cancel, behind it on the stream, comes later
still). Run, the call made the session again, held until the TTL sweep; refused (status
REBUILD) it never runs."""

import time
from collections import OrderedDict

# a late call was sent before its release: it trails it by a hop and a read (milliseconds);
# kept far longer, and a replica remembers at most this many (the oldest go first)
RELEASED_KEPT_S = 60.0
RELEASED_KEPT = 4096


class Released:
    """A tombstone per released request that had no call in the replica (one that had is
    answered by the release itself: ContinuousBatcher.withdraw), until it refuses one call:
    the request's next call. A released request's caller that still lives (a session released
    by an operator, or evicted) learns it from that REBUILD, and its rebuild is served."""

    def __init__(self, kept_s: float = RELEASED_KEPT_S, capacity: int = RELEASED_KEPT,
                 clock=time.monotonic) -> None:
        self.kept_s, self.capacity, self.clock = kept_s, capacity, clock
        self.at: OrderedDict[str, float] = OrderedDict()  # request id -> released at

    def add(self, request_id: str) -> None:
        now = self.clock()
        self.at.pop(request_id, None)
        self.at[request_id] = now
        while len(self.at) > self.capacity or next(iter(self.at.values())) < now - self.kept_s:
            self.at.popitem(last=False)

    def refuses(self, request_id: str) -> bool:
        """Whether the call is one released (its tombstone, if any, is used up)."""
        at = self.at.pop(request_id, None)
        return at is not None and self.clock() - at <= self.kept_s

    def __len__(self) -> int:
        return len(self.at)
