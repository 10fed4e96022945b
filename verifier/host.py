"""One host transfer per verify batch: the calls' picks and draws stay on the device until
the batch is finished, then reach the host together (on a GPU, one synchronisation instead
of one per call).

Inside `one_transfer()`, the verifier's finish and draw_recovered_and_bonus leave their
TargetScores' ids and probabilities on the device: tensors, or `Part`s of one tensor that
holds many calls' values; `to_host` moves all of a batch's answers in one concatenated
float64 copy (ids < 2**53 and probabilities travel exactly) and puts tuples and ints back in
their place. Outside it (a lone call, a test) they return host values at once, as before.
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from speculative.types import LAWLESS, TargetScores

IDS = ("target_token_ids", "recovered_token_ids", "bonus_token_id")
FIELDS = (*IDS, "draft_target_probs", "accept_probs")

_state = threading.local()  # per thread: a batch runs on the worker, or a lone call on the loop


def deferred() -> bool:
    return getattr(_state, "deferred", False)


@contextmanager
def one_transfer():
    _state.deferred = True
    try:
        yield
    finally:
        _state.deferred = False


@dataclass(frozen=True, slots=True, eq=False)
class Part:
    """A field of one call's TargetScores until the batch's transfer: columns start..stop of
    row `row` of `block`, a [N, W] float64 device tensor of N calls' values (one tensor for
    a batch's chains, instead of a view and a copy per field); scalar: one value, not a
    tuple."""

    block: torch.Tensor
    row: int
    start: int
    stop: int
    scalar: bool = False


def to_host(results: list, common=None) -> list:
    """`results` with every TargetScores' device tensors and Parts replaced by host values;
    common() (called once they are on the host) gives fields every TargetScores takes too
    (one `replace` each: at a few microseconds apiece, a batch of short calls felt them)."""
    parts, places, blocks, size = [], [], {}, 0
    for index, result in enumerate(results):
        if not isinstance(result, TargetScores):
            continue
        for name in FIELDS:
            value = getattr(result, name)
            if isinstance(value, Part):
                base = blocks.get(id(value.block))
                if base is None:
                    base = blocks[id(value.block)] = size
                    parts.append(value.block.flatten())
                    size += parts[-1].numel()
                at = base + value.row * value.block.shape[1] + value.start
                places.append((index, name, at, value.stop - value.start, value.scalar))
            elif isinstance(value, torch.Tensor):
                places.append((index, name, size, value.numel(), value.dim() == 0))
                parts.append(value.detach().double().flatten())
                size += parts[-1].numel()
    values = torch.cat([part.to(parts[0].device) for part in parts]).tolist() if parts else []
    changes: dict[int, dict] = {}
    for index, name, at, count, scalar in places:
        chunk = values[at:at + count]
        if name in IDS:
            chunk = [int(v) for v in chunk]
        changes.setdefault(index, {})[name] = chunk[0] if scalar else tuple(chunk)
    if common is not None:
        fields = common()
        for index, result in enumerate(results):
            if isinstance(result, TargetScores):
                changes[index] = {**fields, **changes.get(index, {})}
    out = list(results)
    for index, fields in changes.items():
        out[index] = replace(out[index], **fields)
    return out


def refusing_lawless(results: list, vocab_size: int) -> list:
    """`results` (on the host) with each TargetScores' draws from a row whose probabilities
    are NaN (the target's logits NaN or inf there) made LAWLESS, or the call failed: such a
    draw is index V (torch's searchsorted puts a NaN past every entry:
    speculative.sampling.inverted), and an output must not hold it. The first row's is
    output for sure (its drafted tokens' p is NaN, which the router's test rejects, and a
    call without a draft outputs it): the call fails (a RuntimeError). A later row's is
    output only when the router's coins accept every drafted token before it: marked, it
    fails the round that reaches it (speculative.accept.lawful), and no other."""
    out = list(results)
    for index, result in enumerate(results):
        if not isinstance(result, TargetScores):
            continue
        bonus = () if result.bonus_token_id is None else (result.bonus_token_id,)
        rows = result.target_token_ids or (*result.recovered_token_ids, *bonus)
        if not rows or max(rows) < vocab_size:
            continue
        out[index] = marked_lawless(result, vocab_size) if rows[0] < vocab_size else \
            RuntimeError("verifier: the target's probabilities at a sampled position are "
                         "not finite (NaN or inf logits)")
    return out


def marked_lawless(result: TargetScores, vocab_size: int) -> TargetScores:
    def marked(ids: tuple) -> tuple:
        return tuple(LAWLESS if token >= vocab_size else token for token in ids)

    bonus = result.bonus_token_id
    return replace(result, target_token_ids=marked(result.target_token_ids),
                   recovered_token_ids=marked(result.recovered_token_ids),
                   bonus_token_id=LAWLESS if bonus is not None and bonus >= vocab_size
                   else bonus)
