"""A lean forward for the Llama family (Llama, Mistral, Qwen2) over an attention backend.

Compute: `LeanForward` runs the checkpoint's own modules (embeddings, RMSNorms, rotary
embedding, projections, LM head) with q/k/v and gate/up fused into one matmul each (the
original weights become views of the fused ones: no second copy). All requests' new tokens
are packed into one row [N, hidden]; only attention is per request, and each layer makes it
one backend call for the whole batch (engine.attention: the backend writes the new keys and
values into its pool and attends each request's queries over its own keys, under masks
built once per forward), or one per group where the feeds differ widely in length (a
prompt's prefill beside decodes: `GroupedPlan`, engine.attention.feed_groups).

Architectures outside the family (or with features the lean path does not implement) keep
transformers' own modeling through `engine.batch`; engine.runner picks one at start-up.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.attention import feed_groups


LEAN_MODEL_TYPES = {"llama", "mistral", "qwen2"}


def lean_supported(model) -> str | None:
    """Why the lean path cannot run this model, or None when it can."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    # every layer (a quantized checkpoint can keep some dense), plain Linears only: a
    # subclass (transformers' FP8Linear, bitsandbytes' Linear8bitLt, BitNet's AutoBitLinear)
    # has a forward of its own (scales, quantization) that fusing its raw weight would skip
    for layer in model.model.layers:
        if not hasattr(layer.input_layernorm, "variance_epsilon") or \
                not hasattr(layer.post_attention_layernorm, "variance_epsilon"):
            return "the norms are not Llama's RMSNorm"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if type(getattr(layer.self_attn, name, None)) is not torch.nn.Linear:
                return f"attention has no plain {name}"
        if not all(type(getattr(layer.mlp, n, None)) is torch.nn.Linear
                   for n in ("gate_proj", "up_proj", "down_proj")):
            return "the MLP is not a gated gate/up/down of plain Linears"
    if type(model.lm_head) is not torch.nn.Linear:
        return "the LM head is not a plain Linear"
    return None


def layer_window(attention, config) -> int | None:
    """The window this layer attends within, as transformers' modeling reads it: Qwen2's
    layers carry their own (None on a full layer); Mistral's attention passes the config's
    sliding_window on every layer; Llama's has none, whatever the config names (a config.json
    of a Mistral-derived checkpoint relabelled "llama" can carry one its modeling ignores)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
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


def small_matmul_rows() -> int:
    """Rows up to which x @ W beats oneDNN's packed weights on this CPU, by the two machine
    kinds measured (demo shapes, one thread). On 2-core AMD EPYC VMs with AVX-512 and no AMX,
    the packed copy won from 3 rows (40 x [1536, 256] out of cache: 1 row 3.1 against 4.5 ms,
    2 rows 4.7 against 5.9; 5 rows 9.7 against 4.2, 9 rows 11.9 against 5.4, 32 rows 20
    against 14). On 2-core Intel Xeon VMs with AVX-512 and AMX, in the demo target's whole
    forward x @ W was 10-20 % faster up to 9 rows (1 x 5: 3.8-4.2 against 4.7 ms) and the
    draft's 15-20 % at every batch up to 32 rows; the forward timed each way at start-up
    chose x @ W up to 33 rows in 3 of 3 quiet starts of the target and 14 of 15 of the draft
    (2026-11-29). A fixed rule, not a timing at start-up: timed, two replicas starting
    together chose differently, and the choice moves logits by reassociation. AMX tells the
    two kinds apart; a machine of neither kind keeps the first rule."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return 33 if amx is not None and amx() else 2


SMALL_MATMUL_ROWS = small_matmul_rows()
# weights (in x out entries) below which oneDNN's packed matmul never pays: its call costs
# 30-45 us whatever the size, x @ W 4-10 us on a [32, 64] weight (measured, 2-core AVX2 VM,
# one thread, 3 to 150 rows); from [256, 768] up the two are within 10 % there and packing
# wins on AVX-512 (above). Tiny drafts, and the tests' tiny models, take x @ W at every size
MIN_PACKED_WEIGHT = 65536


class Projection:
    """x -> x W^T + b of one Linear, or of several over the same input fused into one matmul.

    On a CPU the weight is kept [in, out] and applied as x @ W up to SMALL_MATMUL_ROWS rows:
    a one-token matmul streams it from memory about twice as fast as F.linear's [out, in]
    (3.3 against 7.5 ms for 63 MB). For more rows (a verify's K + 1, a batch) oneDNN's
    packed copy of the weight can be 1.4-2.3x faster than either; where the two cross
    depends on the machine (small_matmul_rows). The copy doubles the weights' memory on a
    CPU. A weight under MIN_PACKED_WEIGHT entries has no packed copy: x @ W serves it at
    every size. On a GPU the weight stays [out, in], cuBLAS's own layout. See
    docs/engine.md."""

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
    build or dtype has none, or the weight is too small to gain (then x @ W serves every
    size)."""
    if not torch.backends.mkldnn.is_available() or \
            weight.dtype not in (torch.float32, torch.bfloat16) or \
            weight.numel() < MIN_PACKED_WEIGHT:
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
        self.window = layer_window(attention, config)
        self.qkv = Projection([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = Projection([attention.o_proj])
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj])
        self.down_proj, self.act = Projection([mlp.down_proj]), mlp.act_fn
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.head_dim]


class LeanForward:
    """The packed forward of a Llama-family model over an attention backend (see the module
    doc and engine.attention): the backend owns the KV pool and each layer's attention."""

    def __init__(self, model, attention) -> None:
        reason = lean_supported(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        self.model, config = model, model.config
        self.embed = model.get_input_embeddings()
        self.rotary, self.norm = model.model.rotary_emb, RMSNorm(model.model.norm)
        tied = model.lm_head.weight is self.embed.weight
        self.lm_head = Projection([model.lm_head], copy=tied)
        self.layers = [LeanLayer(layer, config) for layer in model.model.layers]
        self.attention = attention

    def __call__(self, segments) -> list[torch.Tensor]:
        """Each segment's logits [num_logits, V]; segment caches are the backend's."""
        device = self.embed.weight.device
        groups = feed_groups(segments)
        # the backend reserves first: a full pool fails untouched
        plan = self.attention.plan(segments) if groups is None else \
            GroupedPlan(self.attention, segments, groups, device)
        ids = torch.tensor([t for s in segments for t in s.token_ids], device=device)
        ids.clamp_(max=self.embed.num_embeddings - 1)  # a padded draft: as engine.batch
        keep, offset = [], 0
        for segment in segments:
            offset += len(segment.token_ids)
            keep.extend(range(offset - segment.num_logits, offset))
        logits = self.run(ids, plan, torch.tensor(keep, dtype=torch.long, device=device))
        for segment in segments:
            segment.cache.length = segment.start + len(segment.token_ids)
        return list(logits.split([s.num_logits for s in segments]))

    def run(self, ids: torch.Tensor, plan, keep: torch.Tensor) -> torch.Tensor:
        """A forward's device work once its host work is done: the logits [len(keep), V] of
        the packed tokens `ids` [N] laid out by `plan`, at the packed indices `keep`. It
        reads only device tensors and never waits on the device, so a GPU can record it as
        one CUDA graph and replay it (bench.graphs measures that)."""
        hidden = self.embed(ids)  # [N, hidden]
        cos, sin = self.rotary(hidden[None], plan.queries.positions[None])
        cos, sin = cos[0], sin[0]  # [N, D]
        n = hidden.shape[0]
        for index, layer in enumerate(self.layers):
            x = layer.input_norm(hidden)
            qkv = layer.qkv(x).view(n, layer.heads + 2 * layer.kv_heads, layer.head_dim)
            # q's and k's heads lie side by side: one rotary pass for both
            qk = rotate(qkv[:, :layer.heads + layer.kv_heads], cos, sin)
            q, k = qk[:, :layer.heads], qk[:, layer.heads:]
            v = qkv[:, layer.heads + layer.kv_heads:]
            attended = plan(index, q, k, v, layer.window, layer.scaling) \
                if isinstance(plan, GroupedPlan) else \
                self.attention(index, plan, q, k, v, layer.window, layer.scaling)
            hidden = hidden + layer.o_proj(attended)
            gate, up = layer.gate_up(layer.post_norm(hidden)).chunk(2, -1)
            hidden = hidden + layer.down_proj(layer.act(gate) * up)
        return self.lm_head(self.norm(hidden[keep]))


class GroupedPlan:
    """A forward whose segments are laid out in groups (engine.attention.feed_groups), each
    group's plan the backend's own, its attention one backend call over the group's packed
    tokens; `queries.positions` (rotary) are every packed token's, in packed order."""

    def __init__(self, backend, segments, groups: list[list[int]], device) -> None:
        offsets, offset = [], 0
        for segment in segments:
            offsets.append(offset)
            offset += len(segment.token_ids)
        self.backend, self.parts = backend, []
        positions = torch.empty(offset, dtype=torch.long, device=device)
        for group in groups:
            tokens = torch.tensor([offsets[i] + j for i in group
                                   for j in range(len(segments[i].token_ids))], device=device)
            plan = backend.plan([segments[i] for i in group])
            positions[tokens] = plan.queries.positions
            self.parts.append((tokens, plan))
        self.queries = SimpleNamespace(positions=positions)

    def __call__(self, layer: int, q, k, v, window, scale) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for tokens, plan in self.parts:
            out[tokens] = self.backend(layer, plan, q[tokens], k[tokens], v[tokens], window,
                                       scale)
        return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [N, heads, D] at cos, sin [N, D], as transformers' Llama computes
    it (x cos + rotate_half(x) sin, the halves rotated)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
