"""One host transfer per verify batch: the calls' picks and draws stay on the device until
the batch is finished, then reach the host together (on a GPU, one synchronisation instead
of one per call).

Inside `one_transfer()`, the verifier's finish and draw_recovered_and_bonus leave their
TargetScores' ids and probabilities as device tensors; `to_host` moves every such tensor of
a batch's answers in one concatenated float64 copy (ids < 2**53 and probabilities travel
exactly) and puts tuples and ints back in their place. Outside it (a lone call, a test) they
return host values at once, as before.
"""

import threading
from contextlib import contextmanager
from dataclasses import replace

import torch

from speculative.types import TargetScores

IDS = ("target_token_ids", "recovered_token_ids", "bonus_token_id")
FIELDS = (*IDS, "draft_target_probs", "accept_probs")

_state = threading.local()  # the engine's worker thread runs one batch at a time


def deferred() -> bool:
    return getattr(_state, "deferred", False)


@contextmanager
def one_transfer():
    _state.deferred = True
    try:
        yield
    finally:
        _state.deferred = False


def to_host(results: list) -> list:
    """`results` with every TargetScores' device tensors replaced by host values."""
    parts, places = [], []
    for index, result in enumerate(results):
        if not isinstance(result, TargetScores):
            continue
        for name in FIELDS:
            value = getattr(result, name)
            if isinstance(value, torch.Tensor):
                places.append((index, name, value.numel(), value.dim() == 0))
                parts.append(value.detach().double().flatten())
    if not parts:
        return results
    values = torch.cat([part.to(parts[0].device) for part in parts]).tolist()
    out, offset, changes = list(results), 0, {}
    for index, name, count, scalar in places:
        chunk = values[offset:offset + count]
        offset += count
        if name in IDS:
            chunk = [int(v) for v in chunk]
        changes.setdefault(index, {})[name] = chunk[0] if scalar else tuple(chunk)
    for index, fields in changes.items():
        out[index] = replace(out[index], **fields)
    return out
