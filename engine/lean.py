"""A lean forward for the Llama family (Llama, Mistral, Qwen2) over engine.paged's blocks.

Compute: `LeanForward` runs the checkpoint's own modules (embeddings, RMSNorms, rotary
embedding, projections, LM head) with q/k/v and gate/up fused into one matmul each (the
original weights become views of the fused ones: no second copy). All requests' new tokens
are packed into one row, and each layer makes ONE attention call for the whole batch: the
queries padded to [B, H, max_new, D], each request's keys gathered from its blocks into
[B, H_kv, max_len, D], SDPA with GQA (no KV expansion) under one [B, 1, max_new, max_len]
mask built once per forward (causal, the request's own length, the sliding window where a
layer has one). The mask is per request, never N x N over the batch; a tree mask inside
one request's new tokens would replace its causal block.

Architectures outside the family (or with features the lean path does not implement) keep
transformers' own modeling through `engine.batch`.
"""

import torch
import torch.nn.functional as F

from engine.paged import BLOCK_SIZE, BlockPool, PagedCache, kv_pool_blocks

LEAN_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def lean_supported(model) -> str | None:
    """Why the lean path cannot run this model, or None when it can."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    layer = model.model.layers[0]
    if not hasattr(layer.input_layernorm, "variance_epsilon"):
        return "the norms are not Llama's RMSNorm"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not isinstance(getattr(layer.self_attn, name, None), torch.nn.Linear):
            return f"attention has no plain {name}"
    if not all(isinstance(getattr(layer.mlp, n, None), torch.nn.Linear)
               for n in ("gate_proj", "up_proj", "down_proj")):
        return "the MLP is not a gated gate/up/down"
    return None


def fuse(linears: list[torch.nn.Linear], transposed: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linears over the same input; each Linear's own
    parameters become views of it, so the model keeps working and no memory is doubled.

    The weight is [out, in] as F.linear takes it, or [in, out] (`transposed`) for x @ W."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        if transposed:
            weight = weight.t().contiguous()
        has_bias = [linear.bias is not None for linear in linears]
        bias = torch.cat([linear.bias if linear.bias is not None else
                          torch.zeros(linear.out_features, dtype=weight.dtype,
                                      device=weight.device) for linear in linears]) \
            if any(has_bias) else None
    offset = 0
    for linear, with_bias in zip(linears, has_bias):
        rows = slice(offset, offset + linear.out_features)
        own = weight[:, rows].t() if transposed else weight[rows]
        linear.weight = torch.nn.Parameter(own, requires_grad=False)
        if with_bias:
            linear.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
        offset += linear.out_features
    return weight, bias


# rows up to which x @ W beats oneDNN's packed weights on a CPU (measured, demo shapes, one
# thread, weights out of cache, 40 x [1536, 256]: 1 row 3.1 against 4.5 ms, 2 rows 4.7
# against 5.9; 5 rows 9.7 against 4.2, 9 rows 11.9 against 5.4, 32 rows 20 against 14)
SMALL_MATMUL_ROWS = 2


class Projection:
    """x -> x W^T + b of one Linear, or of several over the same input fused into one matmul.

    On a CPU the weight is kept [in, out] and applied as x @ W up to SMALL_MATMUL_ROWS rows:
    a one-token matmul streams it from memory about twice as fast as F.linear's [out, in]
    (3.3 against 7.5 ms for 63 MB). For more rows (a verify's K + 1, a batch) oneDNN's
    packed copy of the weight is 1.4-2.3x faster than either (SMALL_MATMUL_ROWS); the
    copy doubles the weights' memory on a CPU. On a GPU the weight stays [out, in],
    cuBLAS's own layout. See README, The engine."""

    def __init__(self, linears: list[torch.nn.Linear], copy: bool = False) -> None:
        weight = linears[0].weight
        self.transposed = weight.device.type == "cpu"
        if copy:  # a weight shared with another module (tied embeddings): a copy of our own
            self.weight = weight.detach().t().contiguous() if self.transposed else weight
            self.bias = linears[0].bias
        else:
            self.weight, self.bias = fuse(linears, self.transposed)
        self.packed = packed_for_onednn(self.weight.t()) if self.transposed else None

    def __getstate__(self) -> dict:  # a copied model (deepcopy) packs its own copy
        return {**self.__dict__, "packed": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.transposed:
            self.packed = packed_for_onednn(self.weight.t())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None and x.shape[0] > SMALL_MATMUL_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)


def packed_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] weight in oneDNN's blocked layout for its matmul, or None where this torch
    build or dtype has none (then x @ W serves every size)."""
    if not torch.backends.mkldnn.is_available() or \
            weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except (RuntimeError, AttributeError):
        return None


class RMSNorm:
    """A Llama-family RMSNorm as one fused op (F.rms_norm): in float32, then back to the
    input's dtype before the weight, as transformers computes it."""

    def __init__(self, module) -> None:
        self.weight, self.eps = module.weight, module.variance_epsilon
        self.shape = (module.weight.shape[-1],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)


class LeanLayer:
    def __init__(self, layer, config) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm = RMSNorm(layer.input_layernorm)
        self.post_norm = RMSNorm(layer.post_attention_layernorm)
        self.head_dim = attention.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.scaling = attention.scaling
        self.window = getattr(attention, "sliding_window",
                              getattr(config, "sliding_window", None))
        self.qkv = Projection([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = Projection([attention.o_proj])
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj])
        self.down_proj, self.act = Projection([mlp.down_proj]), mlp.act_fn
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.head_dim]


class BatchPlan:
    """The index tensors and masks of one packed forward, built once for all its layers."""

    def __init__(self, segments, pool: BlockPool, windows: set, device) -> None:
        lengths = [len(s.token_ids) for s in segments]
        ends = [s.start + n for s, n in zip(segments, lengths)]
        self.batch, self.max_new, self.max_len = len(segments), max(lengths), max(ends)
        self.num_tokens = sum(lengths)
        self.uniform = all(n == self.max_new for n in lengths)
        self.write_slots = torch.cat([s.cache.slots(s.start, end, device)
                                      for s, end in zip(segments, ends)])
        size = pool.block_size
        blocks = segments[0].cache.blocks
        # one request whose blocks follow each other (a fresh pool hands them out in order):
        # its keys are a slice of the pool, read in place
        self.run = blocks[0] * size if self.batch == 1 and \
            blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None
        self.gather = None if self.run is not None else self.gather_index(segments, ends, size,
                                                                          device)
        self.rows = None
        if not self.uniform:  # packed token -> its (row, j) in the padded layout
            flat = []
            for row, (segment, n) in enumerate(zip(segments, lengths)):
                flat.extend(row * self.max_new + j for j in range(n))
            self.rows = torch.tensor(flat, device=device)
        if self.batch == 1 and self.max_new == 1:  # one query, at the last position
            last = self.max_len - 1  # sees every key, and a window unless it reaches past it
            self.masks = {window: None for window in windows if window is None or last < window}
            if len(self.masks) == len(windows):
                return
        self.masks = self.build_masks(segments, lengths, windows, device)

    def gather_index(self, segments, ends, size: int, device) -> torch.Tensor:
        """Pool slot of each (request, key position) of the padded [B, max_len] layout; the
        padding reads slot 0 (zeros)."""
        gather = torch.zeros(self.batch, self.max_len, dtype=torch.long)
        for row, (segment, end) in enumerate(zip(segments, ends)):
            table = torch.tensor(segment.cache.blocks, dtype=torch.long)
            gather[row, :end] = (table[:, None] * size + torch.arange(size)).flatten()[:end]
        return gather.flatten().to(device)

    def build_masks(self, segments, lengths, windows: set, device) -> dict:
        """{window: [B, 1, max_new, max_len] boolean mask, or None where none is needed}."""
        # query j of row b sits at position start_b + j; a padding query sits at 0
        query_pos = torch.zeros(self.batch, self.max_new, dtype=torch.long)
        for row, (segment, n) in enumerate(zip(segments, lengths)):
            query_pos[row, :n] = torch.arange(segment.start, segment.start + n)
        key_pos = torch.arange(self.max_len)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, max_new, max_len]
        masks = {}
        for window in windows:
            mask = visible if window is None else \
                visible & (query_pos[:, :, None] - key_pos[None, None, :] < window)
            masks[window] = mask[:, None].to(device)
        return masks

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, heads, D] packed -> [B, heads, max_new, D]."""
        if self.uniform:
            return x.view(self.batch, self.max_new, *x.shape[1:]).transpose(1, 2)
        padded = x.new_zeros(self.batch * self.max_new, *x.shape[1:])
        padded[self.rows] = x
        return padded.view(self.batch, self.max_new, *x.shape[1:]).transpose(1, 2)

    def keys(self, cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """[slots, H_kv, D] of one layer -> the batch's [B, H_kv, max_len, D], gathered into
        `out` (a buffer of at least B x max_len slots, reused by every layer)."""
        if self.run is not None:
            return cache[self.run:self.run + self.max_len].unsqueeze(0).transpose(1, 2)
        picked = torch.index_select(cache, 0, self.gather, out=out[:self.gather.numel()])
        return picked.view(self.batch, self.max_len, *cache.shape[1:]).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, max_new, D] -> [N, heads * D] packed."""
        x = x.transpose(1, 2).reshape(self.batch * self.max_new, -1)
        return x if self.uniform else x[self.rows]


class LeanForward:
    """The packed forward of a Llama-family model over a BlockPool (see the module doc)."""

    def __init__(self, model, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        reason = lean_supported(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        self.model, config = model, model.config
        self.embed = model.get_input_embeddings()
        self.rotary, self.norm = model.model.rotary_emb, RMSNorm(model.model.norm)
        tied = model.lm_head.weight is self.embed.weight
        self.lm_head = Projection([model.lm_head], copy=tied)
        self.layers = [LeanLayer(layer, config) for layer in model.model.layers]
        first = self.layers[0]
        self.pool = BlockPool(len(self.layers), num_blocks, first.kv_heads, first.head_dim,
                              self.embed.weight.dtype, self.embed.weight.device, block_size)
        self.windows = {layer.window for layer in self.layers}
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather_buffers(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for a forward's gathered keys and values, kept from one forward to the
        next and grown as needed: a fresh multi-MB tensor per layer is fresh pages from the
        OS on a CPU, and their faults cost more than the gather itself (measured: a
        24 x 1 forward 49 against 16 ms)."""
        if self.gathered is None or self.gathered[0].shape[0] < slots:
            shape = (max(slots, 1024), *self.pool.keys.shape[2:])
            self.gathered = tuple(self.pool.keys.new_empty(shape) for _ in range(2))
        return self.gathered

    def new_cache(self) -> PagedCache:
        return PagedCache(self.pool)

    @torch.no_grad()
    def __call__(self, segments) -> list[torch.Tensor]:
        """Each segment's logits [num_logits, V]; segment caches are PagedCaches."""
        device = self.embed.weight.device
        for segment in segments:  # before any write: a full pool fails the batch untouched
            segment.cache.reserve(segment.start + len(segment.token_ids))
        plan = BatchPlan(segments, self.pool, self.windows, device)
        ids = torch.tensor([t for s in segments for t in s.token_ids], device=device)
        ids.clamp_(max=self.embed.num_embeddings - 1)  # as engine.batch: a padded draft
        positions = torch.tensor([s.start + i for s in segments
                                  for i in range(len(s.token_ids))], device=device)
        hidden = self.embed(ids)  # [N, hidden]
        cos, sin = self.rotary(hidden[None], positions[None])
        cos, sin = cos[0], sin[0]  # [N, D]
        n = plan.num_tokens
        gathered = self.gather_buffers(0 if plan.gather is None else plan.gather.numel())
        for index, layer in enumerate(self.layers):
            x = layer.input_norm(hidden)
            qkv = layer.qkv(x).view(n, layer.heads + 2 * layer.kv_heads, layer.head_dim)
            # q's and k's heads lie side by side: one rotary pass for both
            qk = rotate(qkv[:, :layer.heads + layer.kv_heads], cos, sin)
            q, k = qk[:, :layer.heads], qk[:, layer.heads:]
            v = qkv[:, layer.heads + layer.kv_heads:]
            keys, values = self.pool.keys[index], self.pool.values[index]
            keys.index_copy_(0, plan.write_slots, k)
            values.index_copy_(0, plan.write_slots, v)
            attended = F.scaled_dot_product_attention(
                plan.pad(q), plan.keys(keys, gathered[0]), plan.keys(values, gathered[1]),
                attn_mask=plan.masks[layer.window],
                scale=layer.scaling, enable_gqa=layer.kv_heads != layer.heads)
            hidden = hidden + layer.o_proj(plan.unpad(attended))
            gate, up = layer.gate_up(layer.post_norm(hidden)).chunk(2, -1)
            hidden = hidden + layer.down_proj(layer.act(gate) * up)
        for segment in segments:
            segment.cache.length = segment.start + len(segment.token_ids)
        keep, offset = [], 0
        for segment in segments:
            offset += len(segment.token_ids)
            keep.extend(range(offset - segment.num_logits, offset))
        logits = self.lm_head(self.norm(hidden[torch.tensor(keep, dtype=torch.long,
                                                            device=device)]))
        return list(logits.split([s.num_logits for s in segments]))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [N, heads, D] at cos, sin [N, D], as transformers' Llama computes
    it (x cos + rotate_half(x) sin, the halves rotated)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


ENGINES = ("auto", "paged", "transformers")


def serving_engine(model, engine: str = "auto", kv_cache_tokens: int | None = None,
                   max_sequences: int = 256, max_new_per_sequence: int = 64):
    """The model, ready for engine.batch.forward_packed: with a paged lean forward attached
    (`paged`; `auto` where the architecture allows), or transformers' modeling with packed
    attention (`transformers`; `auto` otherwise)."""
    from engine.batch import LEAN, use_packed_attention

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    model = use_packed_attention(model.eval())
    reason = lean_supported(model) if engine != "transformers" else "transformers asked for"
    if reason is not None:
        if engine == "paged":
            raise ValueError(f"engine paged: {reason}")
        return model
    if getattr(model, LEAN, None) is None:
        blocks = kv_pool_blocks(model, kv_cache_tokens, max_sequences, max_new_per_sequence)
        setattr(model, LEAN, LeanForward(model, blocks))
    return model
