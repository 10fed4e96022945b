"""The attention seam of the lean forward: what every backend shares.

A backend (engine.paged: the reference, a gather from blocks; engine.regions: the CPU
default, reading each request's keys in place) owns the KV pool's layout and makes three
things: a cache for a new request (`new_cache`), the plan of one packed forward, built once
for all layers (`plan`), and each layer's attention over that plan (`__call__`: write the new
keys and values, attend, return [N, heads * head_dim] in packed order).

What they share lives here: the queries of a batch laid out in rows (`Queries`: each row a
request, padded to the batch's longest feed; `feed_groups` splits a batch whose feeds differ
widely into two layouts), one boolean mask per window built once
(causal, the request's own length, the sliding window), and `attend`, which folds the GQA
group into the query axis: [R, H, m, D] queries become [R, H_kv, G * m, D] against
[R, H_kv, L, D] keys, so no call ever combines a mask with `enable_gqa` (on CUDA that pair
sends SDPA to its math kernel: fp32 upcast, keys repeated per head).

A segment may end with a draft tree (`Segment.parents`): its nodes sit in the slots after the
token before them, in node order, each at the position of its depth (its rotary position),
and each sees the keys before the tree and its own ancestors in it, no other node (the
ancestor mask of article 002). `tree_layout` gives both; `masks` applies them per row.
"""

import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.tree import tree_depths


@dataclass
class Queries:
    """A batch's new tokens laid out as `rows` rows of `max_new` queries."""

    rows: int
    max_new: int
    max_len: int  # keys every row reads: the longest request's end
    index: torch.Tensor | None  # packed token -> row * max_new + j (None: already so)
    query_pos: torch.Tensor  # [rows, max_new] slot of each query (a padding one: 0 or last)
    positions: torch.Tensor  # [N] position of each packed token (rotary)
    row_of_token: torch.Tensor  # [N] its row
    slots: torch.Tensor | None = None  # [N] where each writes its key (None: its position)
    # the rows that end with a draft tree: (row, first query of the tree, its slots' first,
    # ancestry [m, m] (node i sees node j), the nodes' positions [m])
    trees: tuple = ()

    @property
    def write_slots(self) -> torch.Tensor:
        return self.positions if self.slots is None else self.slots


def tree_layout(parents) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [m] from 1, ancestry [m, m] bool: node i sees node j, itself included) of a
    draft tree whose node i follows parents[i] (-1: the token before the tree)."""
    ancestry = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestry[node] |= ancestry[parent]
    return torch.tensor(tree_depths(parents)), ancestry


def lay_out(starts: list[int], lengths: list[int], row_of: list[int], rows: int,
            trees: list | None = None) -> Queries:
    """The layout of requests fed `lengths` tokens after `starts` positions, request b in row
    row_of[b] (rows without a request read key 0 only), request b's last len(trees[b])
    tokens a draft tree of those parents (None: no tree). Host tensors, built from host lists
    (a forward's dozen small torch ops cost more than the lists: measured, 270 against 50 us
    for one request)."""
    max_new = max(lengths)
    positions, row_of_token, index, offsets = [], [], [], []
    for start, length, row in zip(starts, lengths, row_of):
        offsets.append(len(positions))
        positions.extend(range(start, start + length))
        row_of_token.extend([row] * length)
        index.extend(range(row * max_new, row * max_new + length))
    plain = rows == len(starts) and row_of == list(range(rows)) and min(lengths) == max_new
    queries = Queries(rows, max_new, max(s + n for s, n in zip(starts, lengths)),
                      None if plain else longs(index),
                      query_positions(starts, lengths, row_of, rows, max_new),
                      longs(positions), longs(row_of_token))
    if trees and any(tree for tree in trees):
        place_trees(queries, starts, lengths, row_of, trees, offsets)
    return queries


def longs(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of the values (through a buffer: torch.tensor of a list reads it
    element by element, 6 times slower at 600)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else \
        torch.zeros(0, dtype=torch.long)


def query_positions(starts, lengths, row_of, rows: int, max_new: int) -> torch.Tensor:
    """[rows, max_new]: the slot each query reads up to, a request's padding queries its
    last, a row without a request 0."""
    if rows * max_new > 4096:  # a long feed beside others: torch's few ops beat the lists
        starts_t, rows_t = torch.tensor(starts), torch.tensor(row_of)
        last = (starts_t + torch.tensor(lengths) - 1)[:, None]
        query_pos = torch.zeros(rows, max_new, dtype=torch.long)
        query_pos[rows_t] = torch.minimum(starts_t[:, None] + torch.arange(max_new), last)
        return query_pos
    table = [0] * (rows * max_new)
    for start, length, row in zip(starts, lengths, row_of):
        first = row * max_new
        table[first:first + length] = range(start, start + length)
        table[first + length:first + max_new] = [start + length - 1] * (max_new - length)
    return longs(table).view(rows, max_new)


def place_trees(queries: Queries, starts, lengths, row_of, trees, offsets) -> None:
    """Give the tree nodes of a layout their depths' positions and their rows' ancestry."""
    slots, placed = queries.positions, []
    positions = slots.clone()
    for start, length, row, parents, offset in zip(starts, lengths, row_of, trees, offsets):
        if not parents:
            continue
        m = len(parents)
        depth, ancestry = tree_layout(parents)
        first = length - m  # the tree's first query; the token before it is its root
        node_pos = start + first - 1 + depth
        positions[offset + first:offset + length] = node_pos
        placed.append((row, first, start + first, ancestry, node_pos))
    queries.positions, queries.slots, queries.trees = positions, slots, tuple(placed)


def masks(queries: Queries, windows: set, group: int, device) -> dict:
    """{window: [rows, 1, group * max_new, max_len] bool mask, or None where every query
    sees every key}: query j of a row sees key positions <= its own, within the window."""
    key_pos = torch.arange(queries.max_len)
    query_pos = queries.query_pos
    lone_last = queries.max_new == 1 and bool((query_pos == queries.max_len - 1).all())
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [rows, max_new, max_len]
    key_at, query_at = key_pos[None, None, :], query_pos[:, :, None]  # positions (rotary)
    if queries.trees:
        key_at = key_pos.repeat(queries.rows, 1)
        query_at = query_pos.clone()
        for row, first, slot, ancestry, node_pos in queries.trees:
            m = len(node_pos)
            visible[row, first:first + m, slot:slot + m] = ancestry
            key_at[row, slot:slot + m] = node_pos
            query_at[row, first:first + m] = node_pos
        key_at, query_at = key_at[:, None, :], query_at[:, :, None]
    out = {}
    for window in windows:
        if lone_last and (window is None or queries.max_len <= window):
            out[window] = None
            continue
        mask = visible if window is None else visible & (query_at - key_at < window)
        out[window] = mask.repeat(1, group, 1)[:, None].to(device)
    return out


def pad(queries: Queries, x: torch.Tensor) -> torch.Tensor:
    """[N, heads, D] packed -> [rows, heads, max_new, D]."""
    if queries.index is None:
        return x.view(queries.rows, queries.max_new, *x.shape[1:]).transpose(1, 2)
    padded = x.new_zeros(queries.rows * queries.max_new, *x.shape[1:])
    padded[queries.index] = x
    return padded.view(queries.rows, queries.max_new, *x.shape[1:]).transpose(1, 2)


def unpad(queries: Queries, x: torch.Tensor) -> torch.Tensor:
    """[rows, heads, max_new, D] -> [N, heads * D] packed."""
    x = x.transpose(1, 2).reshape(queries.rows * queries.max_new, -1)
    return x if queries.index is None else x[queries.index]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float
           ) -> torch.Tensor:
    """SDPA of q [R, H, m, D] over keys/values [R, H_kv, L, D], the GQA group folded into the
    query axis (mask: [R, 1, G * m, L] from `masks`, or None)."""
    rows, heads, m, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    folded = q.reshape(rows, kv_heads, group * m, dim)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, m, dim)  # a GPU kernel's output may be strided


def device_of(queries: Queries, device) -> Queries:
    """The layout's tensors the forward uses, moved to the model's device."""
    index = None if queries.index is None else queries.index.to(device)
    return Queries(queries.rows, queries.max_new, queries.max_len, index, queries.query_pos,
                   queries.positions.to(device), queries.row_of_token)  # slots: host only


def feed_groups(segments) -> list[list[int]] | None:
    """The segments' indices in two groups laid out apart (short feeds, long feeds), or
    None for one layout. One layout pads every row to the longest feed and every row's keys
    to the longest request: a prompt's prefill in a batch of decodes made each decode attend
    as many queries as the prompt has (the demo target's 15 decodes of 5 tokens beside a
    200-token prompt: 118 ms against 50 in two layouts, bench.mixed_batches). Two groups are laid out when that halves the
    queries times keys the rows attend at least; the split keeps the feeds sorted by length."""
    if len(segments) < 2:
        return None
    order = sorted(range(len(segments)), key=lambda i: len(segments[i].token_ids))
    lengths = [len(segments[i].token_ids) for i in order]
    ends = [segments[i].start + len(segments[i].token_ids) for i in order]

    def work(lo: int, hi: int) -> int:
        return (hi - lo) * lengths[hi - 1] * max(ends[lo:hi])

    cuts = [cut for cut in range(1, len(order)) if lengths[cut] != lengths[cut - 1]]
    if not cuts:
        return None
    cut = min(cuts, key=lambda c: work(0, c) + work(c, len(order)))
    if 2 * (work(0, cut) + work(cut, len(order))) > work(0, len(order)):
        return None
    return [sorted(order[:cut]), sorted(order[cut:])]
