"""One forward over many requests: their new tokens packed into one row, each with its own cache.

Every request of a batch feeds a different number of tokens at a different position, on top of
its own `DynamicCache`. The tokens of all requests are packed into a single sequence [1, N]
with each token's own position (`position_ids`), so the projections, the MLP and the LM head
run once over all N tokens, with no padding. Only attention is per request: the model's
attention layers call `packed_attention` (registered with transformers' AttentionInterface),
which appends each request's new keys and values to that request's cache and attends its
queries over its cache alone, causally and within a sliding window where the layer has one.
No position of one request can reach another's logits, and no cache is copied into a batch:
a rollback stays a crop of the request's own cache.

A model forward without a batch (HF `generate`, tests) goes to SDPA unchanged. A model whose
transformers modeling refuses SDPA (`_supports_sdpa = False`: Gemma-2's soft-capped scores,
gpt-oss's attention sinks, which SDPA cannot compute) attends through its modeling's own
eager attention instead, batched or not, as transformers itself would run it.
"""

import functools
import sys
from dataclasses import dataclass

import torch

from engine.attention import tree_layout

ATTENTION = "specserve_packed"
EAGER_ATTENTION = "specserve_packed_eager"  # for models whose modeling refuses SDPA
BATCH_KWARG = "specserve_batch"


class Unfinished:
    """The answer of a call whose feed was cut to the forward's token budget (chunked
    prefill): it waits for the next batch, first in line (deployments.batcher)."""

    def __repr__(self) -> str:
        return "UNFINISHED"


UNFINISHED = Unfinished()


def run_alone(run_batch, call):
    """One call's answer from a batch function (a list of calls in, each one's answer or
    exception out), run alone: again while its feed is cut to the token budget; an exception
    raised."""
    while (answer := run_batch([call])[0]) is UNFINISHED:
        pass
    if isinstance(answer, BaseException):
        raise answer
    return answer


@dataclass
class Segment:
    """One request's part of a packed forward: token_ids fed at positions start.., on cache."""

    cache: object  # engine.runner.TransformersCache, or a pool's (engine.cache.PoolCache)
    token_ids: list[int]
    start: int
    num_logits: int  # logits wanted for the last num_logits of token_ids
    # the last len(parents) of token_ids are a draft tree: node i follows node parents[i]
    # (-1: the token before the tree); None: a chain (engine.attention)
    parents: tuple[int, ...] | None = None


class PackedBatch:
    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        bounds, offset = [], 0
        for segment in segments:
            bounds.append((offset, offset + len(segment.token_ids)))
            offset += len(segment.token_ids)
        self.bounds = bounds
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def mask(self, index: int, kv_len: int, window: int | None, device,
             additive: torch.dtype | None = None) -> torch.Tensor | None:
        """[1, 1, n, kv_len] where query i (position start + i) may see key j: the keys are
        the kv_len positions that end with the request's last new token. `additive`: as
        an eager attention adds it to the scores, 0 where visible, the dtype's min where
        not (transformers' eager masks)."""
        segment = self.segments[index]
        n = len(segment.token_ids)
        if n == 1 and (window is None or kv_len <= window):
            return None  # one query, every key visible
        if additive is not None:
            key = (index, kv_len, window, additive)
            if key not in self._masks:
                visible = self.mask(index, kv_len, window, device)
                self._masks[key] = torch.zeros(visible.shape, dtype=additive, device=device
                                               ).masked_fill_(~visible, torch.finfo(additive).min)
            return self._masks[key]
        key = (index, kv_len, window)
        if key not in self._masks:
            end = segment.start + n
            q_pos = torch.arange(segment.start, end, device=device)[:, None]
            k_pos = torch.arange(end - kv_len, end, device=device)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                if segment.parents:
                    raise ValueError("draft trees need a model without sliding windows or "
                                     "one the lean forward runs")
                visible &= q_pos - k_pos < window
            if segment.parents:  # the tree's nodes see their ancestors only
                m = len(segment.parents)
                visible[n - m:, kv_len - m:] = tree_layout(segment.parents)[1].to(device)
            self._masks[key] = visible[None, None]
        return self._masks[key]


def packed_attention(module, query, key, value, attention_mask, **kwargs):
    """query [1, H, N, D], key/value [1, H_kv, N, D]: the batch's new tokens, packed."""
    return attend_packed(transformers_attention(), None, module, query, key, value,
                         attention_mask, **kwargs)


def packed_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """packed_attention through the module's modeling's own eager attention (scores
    soft-capped, sinks), under additive masks."""
    return attend_packed(eager_attention(type(module)), query.dtype, module, query, key,
                         value, attention_mask, **kwargs)


def attend_packed(attend, additive, module, query, key, value, attention_mask, **kwargs):
    """Each request's queries over its own cache through `attend` (an attention function of
    transformers' signature), its masks additive of that dtype or boolean (None)."""
    batch: PackedBatch | None = kwargs.pop(BATCH_KWARG, None)
    if batch is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    # a model that slides its window by its own mask alone (Qwen2-MoE, PhiMoE: no
    # sliding_window passed) slides the window its cache layer keeps, as that mask does
    window = kwargs.pop("sliding_window", None) or \
        cache_window(batch.segments[0].cache, module.layer_idx)
    kwargs.pop("is_causal", None)
    outputs = []
    for index, (segment, (lo, hi)) in enumerate(zip(batch.segments, batch.bounds)):
        keys, values = segment.cache.update(key[:, :, lo:hi], value[:, :, lo:hi],
                                            module.layer_idx)
        mask = batch.mask(index, keys.shape[-2], window, query.device, additive)
        output, _ = attend(module, query[:, :, lo:hi], keys, values, mask, is_causal=False,
                           **kwargs)
        outputs.append(output)  # [1, n, H, D]
    return torch.cat(outputs, dim=1), None


def cache_window(cache, layer: int) -> int | None:
    """The window a transformers cache's layer keeps (a sliding layer's), else None."""
    kept = cache.layers[layer]
    return kept.sliding_window if getattr(kept, "is_sliding", False) else None


@functools.cache
def transformers_attention():
    """transformers' SDPA attention, after registering packed_attention with its interfaces.
    Imported at first use, not with this module: it loads transformers' modeling code (2 s of
    CPU), which a process that runs no model (Serve's build of an app) need not pay."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionInterface.register(EAGER_ATTENTION, packed_eager_attention)
    # unbatched calls get SDPA's (or eager's) masks; a packed forward builds its own
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    AttentionMaskInterface.register(EAGER_ATTENTION, eager_mask)
    return sdpa_attention_forward


@functools.cache
def eager_attention(module_class):
    """The eager attention of the modeling file that defines this attention module."""
    attend = getattr(sys.modules[module_class.__module__], "eager_attention_forward", None)
    if attend is None:
        raise ValueError(f"{module_class.__name__}'s modeling refuses SDPA and has no "
                         "eager_attention_forward to attend through")
    return attend


def use_packed_attention(model):
    """Route the model's attention through packed_attention (SDPA when called unbatched), or
    packed_eager_attention where transformers' modeling refuses SDPA (`_supports_sdpa`:
    SDPA would raise on Gemma-2's soft-capping and drop gpt-oss's sinks unannounced)."""
    transformers_attention()
    implementation = ATTENTION
    if getattr(model, "_supports_sdpa", True) is False:
        implementation = EAGER_ATTENTION
        eager_attention(type(model))  # refused at start-up, not at the first batch
    model.config._attn_implementation = implementation
    for config in (getattr(model.config, "text_config", None),):
        if config is not None:
            config._attn_implementation = implementation
    return model


def positions_of(segment: Segment) -> list[int]:
    """The positions of a segment's tokens: consecutive, a tree's nodes at their depths."""
    positions = list(range(segment.start, segment.start + len(segment.token_ids)))
    if segment.parents:
        m = len(segment.parents)
        base = positions[-m] - 1
        positions[-m:] = (base + tree_layout(segment.parents)[0]).tolist()
    return positions


def forward_packed(model, segments: list[Segment]) -> list[torch.Tensor]:
    """One forward of transformers' modeling over all segments (each on its own cache,
    attention through packed_attention); returns each segment's logits [num_logits, V]."""
    if model.config._attn_implementation not in (ATTENTION, EAGER_ATTENTION):
        use_packed_attention(model)
    batch = PackedBatch(segments)
    ids = [t for segment in segments for t in segment.token_ids]
    positions = [position for segment in segments for position in positions_of(segment)]
    keep = [hi - segment.num_logits + i for segment, (_, hi) in zip(segments, batch.bounds)
            for i in range(segment.num_logits)]
    device = model.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    # ids past a (differently padded) draft's embedding are fed as its last row: that only
    # changes what the draft conditions on, never the exactness of what it ships
    input_ids.clamp_(max=model.get_input_embeddings().num_embeddings - 1)
    logits = model(input_ids=input_ids, position_ids=torch.tensor([positions], device=device),
                   use_cache=False,
                   logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                   **{BATCH_KWARG: batch}).logits[0]
    out, offset = [], 0
    for segment in segments:
        out.append(logits[offset:offset + segment.num_logits])
        offset += segment.num_logits
    return out
