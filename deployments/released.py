"""The requests a pool replica released lately, for a call of theirs that comes after its
Release: a request's first call on the router's stream to a replica can be overtaken by the
request's Release (another rpc; the call's cancel, behind it on the stream, comes later
still). Run, the call made the session again, held until the TTL sweep; refused (status
REBUILD) it never runs. A request the router ended may have more than one such call: a
draft that timed out (its cancel on its way) and the next round's, both with the whole
prefix while no draft of the request had been answered."""

import time
from collections import OrderedDict

# a late call was sent before its release: it trails it by a hop and a read (milliseconds);
# kept far longer, and a replica remembers at most this many (the oldest go first)
RELEASED_KEPT_S = 60.0
RELEASED_KEPT = 4096


class Released:
    """A tombstone per released request, until it expires. One its router ended
    (ReleaseRequest.ended) refuses every call of the request: the request is over, so any
    call of it was sent before the release. Another (an operator's release of a session
    whose request lives on) is kept only when the release found no call of the request in
    the replica (one that had is answered by the release itself:
    ContinuousBatcher.withdraw), and refuses one call, the request's next: its caller
    learns of the release from that REBUILD, and its rebuild is served."""

    def __init__(self, kept_s: float = RELEASED_KEPT_S, capacity: int = RELEASED_KEPT,
                 clock=time.monotonic) -> None:
        self.kept_s, self.capacity, self.clock = kept_s, capacity, clock
        # request id -> (released at, whether its request ended)
        self.at: OrderedDict[str, tuple[float, bool]] = OrderedDict()

    def add(self, request_id: str, ended: bool = False) -> None:
        """ended: the request's router released it (an operator's release after that leaves
        it ended)."""
        now = self.clock()
        ended |= self.at.pop(request_id, (now, False))[1]
        self.at[request_id] = (now, ended)
        while len(self.at) > self.capacity or next(iter(self.at.values()))[0] < now - self.kept_s:
            self.at.popitem(last=False)

    def refuses(self, request_id: str) -> bool:
        """Whether the call is one released (a tombstone of a request not ended is used
        up)."""
        at, ended = self.at.get(request_id, (None, False))
        if at is None:
            return False
        live = self.clock() - at <= self.kept_s
        if not (ended and live):
            del self.at[request_id]
        return live

    def __len__(self) -> int:
        return len(self.at)
