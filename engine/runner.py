"""The model runner of a pool replica: one model, its attention backend and KV pool, and the
packed forward over them. The verifier and the drafter each own one; nothing is attached to
the transformers model.

`serving_runner` picks the engine once, at start-up, and logs it: the lean forward
(engine.lean: Llama, Mistral, Qwen2) over an attention backend, or transformers' own modeling
with per-request attention (engine.batch) for any other architecture. Backends
(engine.attention): `regions` (engine.regions: keys read in place; the CPU default when the
memory budget holds enough whole-context regions), `paged` (engine.paged: blocks gathered;
the reference, and the default on a GPU, where its SDPA runs the fused memory-efficient
kernel: the GQA group is folded into the query axis, so no call pairs a mask with GQA). On a
GPU the paged backend's small batches replay CUDA graphs (engine.graphs).
"""

import copy
import logging

import torch
from transformers import DynamicCache

from engine.batch import forward_packed, use_packed_attention
from engine.cache import BLOCK_SIZE
from engine.checkpoint import WINDOWLESS_MODEL_TYPES, sliding_window
from engine.graphs import GraphedForward, GraphFailed, graphs_refused
from engine.lean import LeanForward, layer_window, lean_supported
from engine.memory import KVBudgetTooSmall, context_length, kv_shape
from engine.paged import BlockPool, PagedAttention, kv_pool_blocks
from engine.regions import RegionAttention, RegionPool, region_count

ENGINES = ("auto", "paged", "transformers")
ATTENTIONS = ("auto", "paged", "regions")
MIN_REGIONS = 33  # `auto` on a CPU picks regions when the pool holds this many (a batch of 32)

logger = logging.getLogger(__name__)


class TransformersCache(DynamicCache):
    """transformers' cache with the KV interface of engine.cache's (nothing to reserve or
    free; no prefix sharing). Sliding layers record their past, so a rollback reaches back
    as far as the previous call fed (engine.kv)."""

    pool = None

    def __init__(self, config) -> None:
        text = config.get_text_config(decoder=True)
        if text.model_type in WINDOWLESS_MODEL_TYPES and getattr(text, "sliding_window", None):
            # transformers would keep a window of slots that its modeling never slides over
            text = copy.copy(text)
            text.sliding_window = None
        super().__init__(config=text)
        self.activate_past_recording()

    def can_roll_back(self, num_tokens: int) -> bool:
        """Whether every layer still holds what it needs after removing num_tokens: a
        sliding layer must keep min(window - 1, its new length) positions."""
        for layer in self.layers:
            if getattr(layer, "is_sliding", False) and layer.is_initialized:
                kept = layer.keys.shape[-2] - num_tokens
                if kept < min(layer.sliding_window - 1, layer.cumulative_length - num_tokens):
                    return False
        return True

    def missing(self, length: int, start: int | None = None) -> int:
        return 0

    def reserve(self, length: int, start: int | None = None) -> None:
        pass

    def adopt_prefix(self, tokens: list[int], limit: int) -> int:
        return 0

    def publish(self, tokens: list[int]) -> None:
        pass

    def free(self) -> None:
        pass

    retire = free


class ModelRunner:
    """A model and how its packed forward runs: `forward(segments)` -> each segment's logits."""

    def __init__(self, model, lean: LeanForward | None = None,
                 graphs: GraphedForward | None = None) -> None:
        self.model, self.lean, self.graphs = model, lean, graphs
        self.attention = lean.attention.name if lean is not None else "transformers"

    @property
    def pool(self):
        return None if self.lean is None else self.lean.attention.pool

    @property
    def scores_trees(self) -> bool:
        """Whether a forward can score a draft tree: the lean forward always; transformers'
        modeling without sliding windows (its caches keep a window of slots, not of a
        tree's positions)."""
        return self.lean is not None or \
            sliding_window(self.model.config.get_text_config()) is None

    def new_cache(self):
        if self.lean is None:
            return TransformersCache(self.model.config)
        return self.lean.attention.new_cache()

    @torch.inference_mode()  # every forward (the lean one's and transformers') enters here
    def forward(self, segments) -> list[torch.Tensor]:
        bucket = None if self.graphs is None else self.graphs.bucket(segments)
        if bucket is not None:
            try:
                return self.graphs(segments, bucket)
            except GraphFailed:
                pass  # its capture failed (logged): this batch and its bucket run eager
        if self.lean is not None:
            return self.lean(segments)
        return forward_packed(self.model, segments)


def keep_attention_kernels(device: torch.device) -> None:
    """On CUDA, SDPA without cuDNN's kernel (a process-wide switch: a pool replica runs one
    model). torch puts cuDNN's attention first on Hopper and newer GPUs (with cuDNN 9.15 and
    later), and cuDNN builds an execution plan per problem shape, keys' length included,
    cached per thread: an eager batch, whose keys grow every step, would build one per
    forward, each a build on the host. The flash and memory-efficient kernels take any
    length; CUDA graphs' buckets repeat their shapes either way."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def regions_fit(model, max_sequences: int) -> bool:
    """Whether the memory budget holds a batch's worth of whole-context regions."""
    try:
        return region_count(model, None, max_sequences) >= min(MIN_REGIONS, max_sequences + 1)
    except KVBudgetTooSmall:
        return False


def backend(model, attention: str, kv_cache_tokens: int | None, max_sequences: int,
            max_new_per_sequence: int, block_size: int = BLOCK_SIZE):
    """The attention backend and its pool for this model (see the module doc)."""
    layers, kv_heads, head_dim = kv_shape(model)
    weight = model.get_input_embeddings().weight
    group = model.config.num_attention_heads // kv_heads
    windows = {layer_window(layer.self_attn, model.config) for layer in model.model.layers}
    if attention == "auto":
        attention = "paged"
        if weight.device.type == "cpu" and kv_cache_tokens is None and \
                regions_fit(model, max_sequences):
            attention = "regions"
    if attention == "regions":
        regions = region_count(model, kv_cache_tokens, max_sequences)
        pool = RegionPool(layers, regions, kv_heads, context_length(model), head_dim,
                          weight.dtype, weight.device, block_size)
        return RegionAttention(pool, windows, group)
    blocks = kv_pool_blocks(model, kv_cache_tokens, max_new_per_sequence, block_size)
    pool = BlockPool(layers, blocks, kv_heads, head_dim, weight.dtype, weight.device,
                     block_size)
    return PagedAttention(pool, windows, group)


def serving_runner(model, engine: str = "auto", attention: str = "auto",
                   kv_cache_tokens: int | None = None, max_sequences: int = 256,
                   max_new_per_sequence: int = 64, block_size: int = BLOCK_SIZE,
                   cuda_graphs: bool = True) -> ModelRunner:
    """The model's runner: the lean forward over an attention backend (`paged` engine;
    `auto` where the architecture allows), or transformers' modeling with packed attention
    (`transformers`; `auto` otherwise). On a GPU the paged backend's small batches replay
    CUDA graphs (engine.graphs) unless `cuda_graphs` is off (vLLM's `enforce_eager`)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    model = use_packed_attention(model.eval())
    reason = lean_supported(model) if engine != "transformers" else "transformers asked for"
    if reason is not None:
        if engine == "paged":
            raise ValueError(f"engine paged: {reason}")
        logger.info("engine: transformers (%s)", reason)
        return ModelRunner(model)
    chosen = backend(model, attention, kv_cache_tokens, max_sequences, max_new_per_sequence,
                     block_size)
    lean, graphs = LeanForward(model, chosen), None
    keep_attention_kernels(chosen.pool.keys.device)
    if cuda_graphs and chosen.name == "paged" and chosen.pool.keys.device.type == "cuda":
        refused = graphs_refused(lean)
        if refused is None:
            graphs = GraphedForward(lean)  # it holds a block of the pool as its scratch
        else:
            logger.info("engine: no CUDA graphs: %s", refused)
    logger.info("engine: lean, attention %s%s, %d %s in the KV pool", chosen.name,
                ", CUDA graphs" if graphs else "", chosen.pool.free_units,
                chosen.pool.unit_name)
    return ModelRunner(model, lean, graphs)
