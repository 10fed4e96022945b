"""Bounded-load placement by prompt prefix: consistent hashing with bounded loads (Mirrokni,
Thorup and Zadimoghaddam, 2018), over the requests one router has placed on a pool.

A request's first call is placed by the hash of its prompt's start (prefix_route_key),
so that requests that start alike share a replica's prefix cache. Alone, that puts every
request of a hot prefix (an app's fixed system prompt) on one replica, and replicas added to
the pool take none of them. Here a first call goes to its prefix's replica (its home: where
the prefix's last first call landed) only while that replica holds fewer than

    capacity = ceil(load_factor * (requests held + 1) / replicas)

of this router's requests, the calls still waiting for their placement counted; past it the
request spills: straight to the least loaded replica when every replica of the pool has
answered this router once, else through Serve's proxy by its own key (the hash ring then
places it as any request, and the replica that answers becomes known). With one replica
nothing spills. The pool's replica count comes from Serve (`serve.status()`, at most once
every REFRESH_S, off the event loop); until it is known, the replicas seen stand for it.
"""

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import math
from collections import Counter, OrderedDict

from speculative.prefixes import prefix_hash

log = logging.getLogger("ray.serve")
PREFIX = "prefix-"  # the route keys placed by a prompt's start (prefix_route_key)
ROUTE_PREFIX_TOKENS = 32  # two KV blocks: a shared prompt start worth placing together
HOMES_KEPT = 4096  # prefixes whose replica is remembered, the least recently placed dropped
REFRESH_S = 10.0
COUNT_TIMEOUT_S = 5.0  # a count not read by then is unreadable (a controller that hangs)


def prefix_route_key(request_id: str, sync, tokens: int = ROUTE_PREFIX_TOKENS,
                     placement: str = "", cache_key: str = "") -> str:
    """What a call that carries a whole prompt is placed by: the hash of its first `tokens`
    tokens, so requests that start alike land on the replica that holds that prefix in its
    cache (a hint: any replica answers exactly; the call's later calls go to the replica it
    landed on, pinned); a shorter prompt (or every prompt when tokens is 0): `placement`,
    which the choices of one HTTP request share, else the request id. A call with a
    `cache_key` (OpenAI's prompt_cache_key, after its cache salt): the key's hash, whatever
    the prompt's length, so that the turns of a conversation that names one meet its cache
    (its first turn shorter than `tokens`, its later ones not) and a hot prefix's requests
    of several keys spread by key; bounded as a prefix's (LoadBound). Other calls: the
    request id."""
    if sync.known_len != 0:
        return request_id
    if cache_key:
        digest = hashlib.blake2b(cache_key.encode("utf-8", "surrogatepass"), digest_size=8)
        return f"{PREFIX}key-{digest.hexdigest()}"
    if tokens <= 0 or len(sync.new_token_ids) < tokens:
        return placement or request_id
    return f"{PREFIX}{prefix_hash(list(sync.new_token_ids[:tokens])):x}"


class LoadBound:
    def __init__(self, load_factor: float | None, count=None) -> None:
        """load_factor: None places by prefix alone (no bound); count: a function giving the
        pool's running replicas (None where unknown), run on a thread."""
        self.load_factor, self.count = load_factor, count
        self.replicas: int | None = None
        self.read = True  # whether the last count was read (a failure is logged once)
        self.counted_at = -math.inf
        self._counting: asyncio.Task | None = None
        self.homes: OrderedDict[str, str] = OrderedDict()  # prefix key -> replica address
        self.known: dict[str, None] = {}  # the replicas that answered, in order seen
        self.joining: Counter[str] = Counter()  # prefix key -> first calls not yet pinned

    def bounds(self, key: str) -> bool:
        return self.load_factor is not None and key.startswith(PREFIX)

    @contextlib.contextmanager
    def joined(self, key: str):
        """A first call of route key `key` waiting for its placement, counted against its
        prefix's replica until it is pinned (then its pin counts it: never both)."""
        if not self.bounds(key):
            yield
            return
        self.joining[key] += 1
        try:
            yield
        finally:
            self.joining[key] -= 1
            if not self.joining[key]:
                del self.joining[key]

    def capacity(self, pins: dict[str, str], placing: int = 1) -> int:
        """ceil(load_factor x requests held / replicas), with the calls not yet pinned and
        `placing` more (the call being placed, when not among them)."""
        held = len(pins) + sum(self.joining.values()) + placing
        replicas = max(self.replicas or 0, len(self.known), 1)
        return math.ceil(self.load_factor * held / replicas)

    def spill(self, key: str, pins: dict[str, str]) -> tuple[bool, str | None]:
        """(whether a first call of route key `key` leaves its prefix's replica, and the
        replica it goes to directly: None through the proxy by its own key)."""
        if not self.bounds(key):
            return False, None
        self.refresh()
        home = self.homes.get(key)
        if home is None:  # where the prefix lands is not known yet: the proxy says (beside)
            return False, None
        loads = Counter(pins.values())
        capacity = self.capacity(pins)
        if loads[home] + self.joining[key] < capacity:
            return False, None
        return self.elsewhere(home, loads, capacity)

    def beside(self, key: str, address: str, pins: dict[str, str]) -> str | None:
        """Where a first call that waited for its prefix's placement goes: the replica the
        prefix landed on while it holds fewer than its capacity (the calls still waiting
        counted), else where elsewhere says (None: through the proxy by its own key)."""
        if not self.bounds(key):
            return address
        loads = Counter(pins.values())
        capacity = self.capacity(pins, placing=0)  # this call is among those joining
        if loads[address] < capacity:
            return address
        spilled, least = self.elsewhere(address, loads, capacity)
        return least if spilled else address

    def elsewhere(self, home: str, loads: Counter, capacity: int) -> tuple[bool, str | None]:
        """Where a call its prefix's full replica `home` turns away goes: (True, None)
        through the proxy by its own key while the pool has replicas this router has not
        met (Serve's ring finds them); (True, the known replica with the fewest requests)
        when it is under capacity; (False, None) when none is: it stays at home."""
        if len(self.known) < (self.replicas or 0):
            return True, None
        others = [address for address in self.known if address != home]
        least = min(others, key=loads.__getitem__, default=None)
        return (True, least) if least is not None and loads[least] < capacity else (False, None)

    def landed(self, key: str, address: str) -> None:
        """A call placed through the proxy by `key` landed on `address`."""
        self.known[address] = None
        if self.bounds(key):
            self.homes[key] = address
            self.homes.move_to_end(key)
            while len(self.homes) > HOMES_KEPT:
                self.homes.popitem(last=False)

    def forget(self, address: str) -> None:
        """A replica gone: neither a home nor a replica to spill to."""
        self.known.pop(address, None)
        for key in [key for key, home in self.homes.items() if home == address]:
            del self.homes[key]

    async def counted(self, deadline: float) -> None:
        """Wait, within the deadline, for a replica count being read (a burst's calls that
        waited for their prefix's first placement would else be bounded by the replicas
        seen, one)."""
        if self._counting is not None:
            left = deadline - asyncio.get_running_loop().time()
            await asyncio.wait([self._counting], timeout=max(0.0, left))

    def refresh(self) -> None:
        """Ask for the replica count in the background when it is older than REFRESH_S."""
        loop = asyncio.get_running_loop()
        if self.count is None or self._counting is not None or \
                loop.time() - self.counted_at < REFRESH_S:
            return
        # in a context of its own: under the request's (Ray's id of its task), the client's
        # disconnect cancelled Serve's status call, which every request shares (run: 3.10's
        # create_task has no context argument)
        self._counting = contextvars.Context().run(loop.create_task, self._recount())

    async def _recount(self) -> None:
        try:
            self.replicas = await asyncio.wait_for(asyncio.to_thread(self.count),
                                                   COUNT_TIMEOUT_S)
            self.read = True
        except Exception as error:  # Serve's status unreadable: the replicas seen stand for it
            if self.read:  # said when it starts failing, not every REFRESH_S
                log.warning("the pool's replica count is unreadable (%s): requests of a hot "
                            "prefix are bounded by the replicas this router has met", error)
            self.replicas, self.read = None, False
        finally:
            self.counted_at = asyncio.get_running_loop().time()
            self._counting = None


def running_replicas(application: str) -> int | None:
    """The running replicas of a Serve application's deployments (a pool's one)."""
    from ray import serve

    status = serve.status().applications.get(application)
    if status is None:
        return None
    return sum(deployment.replica_states.get("RUNNING", 0)
               for deployment in status.deployments.values()) or None
