"""The KV interface every pool shares: units handed out with reference counts, caches with a
length that rolls back, released caches kept for their prefixes until the memory is needed.

A pool (engine.paged's blocks, engine.regions' regions) hands out numbered units, lowest free
first, each with a reference count: a cache holds its units; a unit shared by a prefix hit
(engine.paged) is held by every cache that reads it, and returns to the free list when the
last reference goes (`release`). A cache's life is explicit: `free()` gives its units back at
once; `retire()` keeps them, and the full blocks of its committed prompt, for a later request
that starts with the same prefix (prefix caching), until an allocation needs the memory
(least recently retired first). Nothing is freed by the garbage collector.

Prefix caching: the committed prompt of a request is cut into full blocks of block_size
tokens; each block is named by the hash of every token up to its end (a chain), so a block
name stands for the whole prefix before it, as in vLLM. `PrefixIndex` maps names to the caches
that hold the block; a new request adopts the longest chain it finds (engine.paged shares the
blocks, engine.regions copies them) and prefills only the rest.
"""

import array
import hashlib
import heapq
from collections import Counter, OrderedDict

from speculative.types import PoolBusy

BLOCK_SIZE = 16


class KVCacheFull(PoolBusy):
    """The pool has no free unit left for a feed (now: a pause may find one)."""


def block_name(previous: int, tokens: list[int]) -> int:
    """A block's chain name: a 128-bit BLAKE2b of the previous block's name and its tokens
    (not Python's hash, whose collisions can be built, nor 64 bits, where a collision costs
    about 2^32 hashes: a collision would share one request's keys with another's, whose
    prompt a client chose to match it)."""
    data = previous.to_bytes(16, "little") + array.array("i", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def block_names(tokens: list[int], block_size: int = BLOCK_SIZE,
                known: list[int] = (), root: int = 0) -> list[int]:
    """The chain name of each full block of `tokens`: it names every token up to its end.
    `known`: the names of its first blocks, already computed (only the rest are); `root`:
    the name the chain starts from (salted_root)."""
    names = list(known)
    name = names[-1] if names else root
    for end in range((len(names) + 1) * block_size, len(tokens) + 1, block_size):
        name = block_name(name, tokens[end - block_size:end])
        names.append(name)
    return names


def salted_root(salt: str) -> int:
    """The name a request's block chain starts from: 0, or for vLLM's cache_salt one of its
    own, so that only requests of the same salt share prompt blocks (a tenant cannot learn
    from another's cache hits whether it sent a prompt)."""
    if not salt:
        return 0
    digest = hashlib.blake2b(b"cache_salt:" + salt.encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


class PrefixIndex:
    """Block name -> the (cache, block number) of every cache holding that committed prompt
    block (several: a request that adopted a prefix publishes it too, so it stays found
    when the cache it came from is evicted)."""

    def __init__(self) -> None:
        self.holders: dict[int, dict[int, tuple[object, int]]] = {}

    def publish(self, cache, names: list[int], start: int) -> None:
        for number in range(start, len(names)):
            self.holders.setdefault(names[number], {})[id(cache)] = (cache, number)

    def withdraw(self, cache, names: list[int], start: int) -> None:
        for number in range(start, len(names)):
            held = self.holders.get(names[number])
            if held is not None and held.get(id(cache), (None,))[0] is cache:
                del held[id(cache)]
                if not held:
                    del self.holders[names[number]]

    def held_elsewhere(self, cache, names: list[int], retired) -> bool:
        """Whether a retired cache other than `cache` publishes the whole chain `names` (a
        holder of its last block holds them all). `retired`: the pool's, by id. A running
        holder does not count: it may yet be freed (a failed call) or cut back, and the
        prefix would go with it."""
        last = len(names) - 1
        return any(other is not cache and number == last and id(other) in retired
                   for other, number in self.holders.get(names[-1], {}).values())

    def longest(self, names: list[int]) -> tuple[object, int]:
        """(a cache holding the first n blocks, n) for the longest n found, else (None, 0): a
        cache publishes its blocks from the first on, so a holder of block n holds 0..n."""
        for number in range(len(names) - 1, -1, -1):
            for cache, held_number in self.holders.get(names[number], {}).values():
                if held_number == number:
                    return cache, number + 1
        return None, 0


class UnitPool:
    """Numbered units (1..count - 1; unit 0 is never handed out) with reference counts, the
    prefix index, and the retired caches kept for their prefixes."""

    unit_name = "units"

    def __init__(self, count: int, block_size: int = BLOCK_SIZE) -> None:
        if count < 2:
            raise ValueError(f"a KV pool needs at least 2 {self.unit_name}, got {count}")
        self.count, self.block_size = count, block_size
        self.refs = [0] * count
        self._free = list(range(1, count))  # a heap: the lowest unit first
        self.prefixes = PrefixIndex()
        self.retired: OrderedDict[int, object] = OrderedDict()  # id(cache) -> cache
        # each unit's references that retired caches hold, and the units they alone hold
        # (evictable_units), kept up to date as references come and go (about 3 us more a
        # session's life on a 2-core VM): the usage gauge reads them after every batch, and
        # a recount of the retired caches' units took 7-8 ms on a full pool of 28,000 blocks
        self.retired_refs = [0] * count
        self._evictable = 0

    @property
    def free_units(self) -> int:
        return len(self._free)

    @property
    def evictable_units(self) -> int:
        """Units the retired caches alone hold (what evicting them all would free)."""
        return self._evictable

    @property
    def usage(self) -> float:
        """The share of the units that running caches hold, as vLLM's kv_cache_usage_perc:
        neither free nor held by retired caches alone (an allocation evicts those at once,
        as vLLM counts its cached blocks that no request holds as free)."""
        return 1 - (len(self._free) + self._evictable) / (self.count - 1)

    def frees(self, needed: int, caches) -> bool:
        """Whether freeing these caches gives back at least `needed` units (_freeing's
        count, read cache by cache and stopped once reached: a full pool, its units held by
        retired prefixes, is the steady state, and counting every cache's units at each
        admission that needed an eviction took 15 ms on a pool of 28,000 blocks)."""
        return needed <= 0 or any(freed >= needed for freed in self._freeing(caches))

    def _freeing(self, caches):
        """The units that freeing the caches' first 1, 2, ... would give back (non-
        decreasing): those whose every reference is theirs. Caches can share a unit between
        them (a request rebuilt from its own retired prefix, then retired again): neither
        alone frees it, both do."""
        held, freed = Counter(), 0
        for cache in caches:
            for unit in cache.units:
                held[unit] += 1
                freed += held[unit] == self.refs[unit]  # its last reference, once
            yield freed

    def allocate(self, count: int) -> list[int]:
        while count > len(self._free) and self.retired:
            next(iter(self.retired.values())).free()  # the least recently retired
        if count > len(self._free):
            raise KVCacheFull(f"the KV cache needs {count} more {self.unit_name}, "
                              f"{len(self._free)} of {self.count - 1} are free")
        units = [heapq.heappop(self._free) for _ in range(count)]
        for unit in units:
            self.refs[unit] = 1
        return units

    def share(self, units: list[int]) -> list[int]:
        """A running cache's references to these held units."""
        for unit in units:
            self._evictable -= self.refs[unit] == self.retired_refs[unit]
            self.refs[unit] += 1
        return list(units)

    def release(self, units: list[int]) -> None:
        """A running cache's references to these units dropped (a retired cache's go when
        it is reclaimed first: PoolCache.free)."""
        for unit in units:
            refs = self.refs[unit] = self.refs[unit] - 1
            if refs == 0:
                heapq.heappush(self._free, unit)
            else:
                self._evictable += refs == self.retired_refs[unit]

    def retire(self, cache) -> None:
        self.retired[id(cache)] = cache
        for unit in cache.units:
            self.retired_refs[unit] += 1
            self._evictable += self.retired_refs[unit] == self.refs[unit]

    def reclaim(self, cache) -> bool:
        """Take a retired cache back (it is being adopted or freed); whether it was one."""
        if self.retired.pop(id(cache), None) is None:
            return False
        for unit in cache.units:
            self._evictable -= self.retired_refs[unit] == self.refs[unit]
            self.retired_refs[unit] -= 1
        return True


class PoolCache:
    """One request's keys and values in a pool: its units, a length, and the names of its
    published prompt blocks. Subclasses place positions in units (missing, reserve, adopt)."""

    def __init__(self, pool: UnitPool) -> None:
        self.pool, self.units, self.length = pool, [], 0
        self.names: list[int] = []  # published block names, in order
        self.root = 0  # the name its chain starts from (salted_root)

    def get_seq_length(self) -> int:
        return self.length

    def can_roll_back(self, num_tokens: int) -> bool:
        return True  # every position is kept: a rollback is a length reset

    def crop(self, max_length: int) -> None:
        """Keep the first max_length positions; zero or negative: drop that many from the end
        (as engine.kv calls it, crop(-removed): crop(-0) keeps everything). A published
        block cut into is withdrawn from the prefix index."""
        self.length = max(0, self.length + max_length if max_length <= 0 else
                          min(max_length, self.length))
        kept = self.length // self.pool.block_size
        if kept < len(self.names):
            self.pool.prefixes.withdraw(self, self.names, kept)
            del self.names[kept:]

    def publish(self, tokens: list[int]) -> None:
        """Name the full blocks of `tokens` (a committed prefix this cache holds) for prefix
        hits, from the first block not yet named."""
        start = len(self.names)
        self.names = block_names(tokens, self.pool.block_size, self.names, self.root)
        self.pool.prefixes.publish(self, self.names, start)

    def adopt_prefix(self, tokens: list[int], limit: int) -> int:
        """Start this (empty) cache from the longest published prefix of `tokens`, at most
        `limit` tokens; returns the tokens adopted (a multiple of the block size)."""
        size = self.pool.block_size
        names = block_names(tokens[:limit - limit % size], size, root=self.root)
        holder, blocks = self.pool.prefixes.longest(names)
        if blocks == 0 or holder is self:
            return 0
        if id(holder) in self.pool.retired:  # a hit keeps its holder longest
            self.pool.retired.move_to_end(id(holder))
        try:
            self.adopt(holder, blocks * size)
        except KVCacheFull:  # no room to copy into now: a plain prefill, admitted as any
            return 0
        self.length = blocks * size
        return self.length

    def adopt(self, holder: "PoolCache", tokens: int) -> None:
        raise NotImplementedError

    def free(self) -> None:
        """Give every unit back now."""
        self.pool.reclaim(self)
        self.pool.prefixes.withdraw(self, self.names, 0)
        self.pool.release(self.units)
        self.units, self.length, self.names = [], 0, []

    def retire(self) -> None:
        """Keep the units while the prompt blocks may serve a later request; freed when an
        allocation needs them. A cache with nothing published is freed at once, and so is
        one whose whole chain a retired cache publishes (it adopted that cache's prefix and
        added no full block: requests with one prompt and short outputs). Kept, such caches
        added no prefix, and in engine.paged held only blocks shared with the other, so no
        allocation ever needed them gone: one retired cache per request, without end."""
        if self.names and not self.pool.prefixes.held_elsewhere(self, self.names,
                                                                self.pool.retired):
            self.pool.retire(self)
        else:
            self.free()
