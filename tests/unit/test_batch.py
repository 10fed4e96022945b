"""Batching across requests: one packed forward answers every request exactly as if alone.

The bug to catch is a position of one request (or a padded / later position of its own)
leaking into another's logits; a cache fed twice in one forward. Reference: a fresh full
forward of each request's own tokens. The pools' batches over it (a refusal that takes its
batch-mates down, drafts and verifies in a batch against each alone): test_batch_pools.
"""

import pytest
import torch

from engine import batch as packed
from engine import lean, paged, regions
from engine.kv import SessionStore
from engine.runner import serving_runner
from speculative.prefixes import prefix_hash
from speculative.types import PrefixSync
from tests.tiny import tiny_llama, tiny_sliding

ATOL = 1e-4  # float reassociation only (see test_kv); a leak moves logits by O(1)

MODELS = {"llama": lambda: tiny_llama(1), "mistral-sliding": lambda: tiny_sliding(2),
          "qwen2-mixed": lambda: tiny_sliding(3, mixed=True)}
ENGINES = ["transformers", "paged", "regions"]  # transformers' modeling, or a lean backend
PLANS = {"paged": paged.PagedPlan, "regions": regions.RegionPlan}


def served(name: str, engine: str):
    """The named tiny model's runner as a pool serves it: transformers' modeling, or the lean
    forward over an attention backend."""
    if engine == "transformers":
        return serving_runner(MODELS[name](), "transformers")
    return serving_runner(MODELS[name](), "paged", engine, kv_cache_tokens=4096)


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0]


def sync(known, new):
    return PrefixSync(len(known), prefix_hash(known), tuple(new))


def batched_rounds_error(runner) -> float:
    """Four requests of different lengths (some past the sliding window), three rounds of
    verify-then-rollback, every round one packed forward; the largest gap to a fresh forward."""
    store = SessionStore(8)
    prompts = [[3, 1, 4], list(range(5, 16)), [9] * 20, [2, 7, 1, 8, 2, 8]]
    committed = [list(p) for p in prompts]
    known = [[] for _ in prompts]
    worst = 0.0
    for round_ in range(3):
        segments, wanted = [], []
        for i, ids in enumerate(committed):
            sequence = store.apply(f"r{i}", sync(known[i], ids[len(known[i]):]))
            known[i] = list(ids)
            drafted = [(7 * i + round_ + j) % 60 for j in range(1 + (i + round_) % 4)]
            segments.append(sequence.segment(runner, drafted, num_logits=len(drafted) + 1))
            wanted.append(ids + drafted)
        for logits, ids, segment in zip(runner.forward(segments), wanted, segments):
            reference = full_logits(runner.model, ids)[-segment.num_logits:]
            gap = float((logits - reference).abs().max())
            worst = max(worst, gap if gap == gap else float("inf"))  # NaN: as far off as can be
        for i, ids in enumerate(committed):  # accept part of the block, reject the rest
            ids.extend(wanted[i][len(ids):len(ids) + round_ % 2] + [(11 * i + round_) % 60])
    return worst


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", MODELS)
def test_a_packed_batch_equals_each_request_alone(name, engine):
    assert batched_rounds_error(served(name, engine)) < ATOL


@pytest.mark.parametrize("small_rows", [2, 33])  # the rule of either machine kind
def test_a_packed_batch_with_weights_large_enough_to_pack_equals_each_request_alone(
        monkeypatch, small_rows):
    """Hidden 256: the projections take oneDNN's packed matmul for a batch's rows past
    small_rows, x @ W below (the tiny models' weights are too small to pack:
    engine.lean.MIN_PACKED_WEIGHT)."""
    runner = serving_runner(tiny_llama(1, hidden=256), "paged", "paged", kv_cache_tokens=4096)
    layer = runner.lean.layers[0]
    assert all(p.packed is not None for p in (layer.qkv, layer.gate_up, layer.down_proj))
    assert runner.lean.lm_head.packed is None  # [256, 64]: below the size that gains
    monkeypatch.setattr(lean, "SMALL_MATMUL_ROWS", small_rows)
    assert batched_rounds_error(runner) < ATOL


@pytest.mark.parametrize("amx, rows", [(True, 33), (False, 2), (None, 2)])
def test_x_at_w_serves_up_to_the_rows_of_the_machine_kind(monkeypatch, amx, rows):
    if amx is None:  # a torch without the probe
        monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    else:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert lean.small_matmul_rows() == rows


@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_the_test_sees_a_query_that_attends_past_its_position(name, monkeypatch):
    """Mutant: no mask inside a request's segment (a query sees the drafted tokens after it,
    and a sliding layer forgets its window)."""
    monkeypatch.setattr(packed.PackedBatch, "mask", lambda self, *args: None)
    assert batched_rounds_error(served(name, "transformers")) > 0.01


@pytest.mark.parametrize("backend", PLANS)
@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_the_test_sees_a_lean_batch_without_its_mask(name, backend, monkeypatch):
    """Mutant of each attention backend: every key of the padded batch visible (later
    drafted tokens, another request's padding, positions past the window)."""
    plan_init = PLANS[backend].__init__

    def unmasked(self, *args):
        plan_init(self, *args)
        self.masks = dict.fromkeys(self.masks)

    monkeypatch.setattr(PLANS[backend], "__init__", unmasked)
    assert batched_rounds_error(served(name, backend)) > 0.01


@pytest.mark.parametrize("backend", PLANS)
@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_the_test_sees_a_write_to_the_wrong_place(name, backend, monkeypatch):
    """Mutant: a cache's positions written one block (paged) or one region off, into
    another request's keys."""
    plan_init = PLANS[backend].__init__

    def shifted(self, segments, pool, *args):
        plan_init(self, segments, pool, *args)
        if backend == "paged":
            self.write_slots = self.write_slots + pool.block_size
        else:
            self.write_rows = self.write_rows + pool.keys.shape[2] * pool.keys.shape[3]

    monkeypatch.setattr(PLANS[backend], "__init__", shifted)
    assert batched_rounds_error(served(name, backend)) > 0.01


def test_no_attention_call_combines_a_mask_with_gqa(monkeypatch):
    """On CUDA a mask with enable_gqa sends SDPA to its math kernel: every backend folds the
    GQA group into the query axis instead (the tiny models have 4 heads over 2 KV heads)."""
    calls, inside = [], []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def watched(q, k, v, attn_mask=None, **kwargs):
        if inside:  # the runner's forward, not the reference's
            calls.append((attn_mask is not None, kwargs.get("enable_gqa", False),
                          q.shape[1], k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", watched)
    for backend in PLANS:
        runner = served("llama", backend)
        forward = runner.forward

        def inside_forward(segments, forward=forward):
            inside.append(1)
            try:
                return forward(segments)
            finally:
                inside.pop()

        runner.forward = inside_forward
        batched_rounds_error(runner)
    assert calls and any(masked for masked, *_ in calls)
    assert not any(masked and gqa for masked, gqa, *_ in calls)
    assert all(heads == kv_heads for _, _, heads, kv_heads in calls)


@pytest.mark.parametrize("seed", range(4))
def test_the_layout_places_each_query_as_its_definition_says(seed):
    """engine.attention.lay_out against the layout written out query by query: request b's
    j-th new token is at position start_b + j, in row row_of[b], column j; a row's padding
    queries read up to its last token, a row without a request reads key 0. Random batches
    (seeded), rows left empty, and feeds long enough to take the layout's torch path."""
    import random

    from engine.attention import lay_out

    rng = random.Random(seed)
    for _ in range(50):
        count = rng.randint(1, 6)
        lengths = [rng.choice([1, 2, 5, rng.randint(1, 1500)]) for _ in range(count)]
        starts = [rng.randint(0, 300) for _ in range(count)]
        rows = count + rng.choice([0, 0, rng.randint(1, 3)])
        row_of = sorted(rng.sample(range(rows), count))
        queries = lay_out(starts, lengths, row_of, rows)
        width = max(lengths)
        query_pos = [[0] * width for _ in range(rows)]
        positions, token_rows, index = [], [], []
        for start, length, row in zip(starts, lengths, row_of):
            for j in range(width):
                query_pos[row][j] = start + min(j, length - 1)
            for j in range(length):
                positions.append(start + j)
                token_rows.append(row)
                index.append(row * width + j)
        assert queries.query_pos.tolist() == query_pos
        assert queries.positions.tolist() == positions
        assert queries.row_of_token.tolist() == token_rows
        assert (queries.index is None and index == list(range(len(index)))
                or queries.index.tolist() == index)
        assert (queries.rows, queries.max_new, queries.max_len) == (
            rows, width, max(s + n for s, n in zip(starts, lengths)))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_llama_config_naming_a_sliding_window_attends_to_the_whole_context(engine):
    """transformers' Llama reads no sliding_window: a config.json that names one (a
    Mistral-derived checkpoint relabelled "llama") must not make the served forward slide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.checkpoint import sliding_window

    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, sliding_window=8)
    model = LlamaForCausalLM(config).eval()
    runner = serving_runner(model, "transformers") if engine == "transformers" else \
        serving_runner(model, "paged", engine, kv_cache_tokens=4096)
    ids = [(7 * i) % 64 for i in range(30)]
    cache = runner.new_cache()
    got = torch.cat([runner.forward([packed.Segment(cache, ids[:20], 0, 20)])[0],
                     runner.forward([packed.Segment(cache, ids[20:], 20, 10)])[0]])
    assert float((got - full_logits(model, ids)).abs().max()) < ATOL
    assert sliding_window(config) is None and runner.scores_trees


class Doubled(torch.nn.Linear):
    """A Linear with a forward of its own, as transformers' quantized linears (FP8Linear,
    bitsandbytes' Linear8bitLt, AutoBitLinear) subclass nn.Linear with their scales."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_linears_with_a_forward_of_their_own_keep_transformers_modeling():
    model = tiny_llama(6)
    attention = model.model.layers[1].self_attn
    doubled = Doubled(attention.v_proj.in_features, attention.v_proj.out_features, bias=False)
    doubled.weight = attention.v_proj.weight
    attention.v_proj = doubled
    assert "v_proj" in lean.lean_supported(model)
    runner = serving_runner(model)  # auto: transformers' modeling
    assert runner.lean is None
    ids = [(5 * i) % 64 for i in range(12)]
    [logits] = runner.forward([packed.Segment(runner.new_cache(), ids, 0, len(ids))])
    assert float((logits - full_logits(model, ids)).abs().max()) < ATOL


@pytest.mark.parametrize("backend", PLANS)
def test_a_lone_decode_step_one_past_the_window_does_not_see_the_first_key(backend):
    """One request fed one token at a time past its sliding window (8): at every length the
    logits are a fresh forward's, the step whose query stands at position `window` (the one
    that must stop seeing key 0) included."""
    runner = served("mistral-sliding", backend)
    store = SessionStore(2)
    ids = [(5 * i + 3) % 60 for i in range(12)]
    for length in range(6, 13):
        known = ids[:length - 1] if length > 6 else []
        sequence = store.apply("r", sync(known, ids[len(known):length]))
        [logits] = runner.forward([sequence.segment(runner, [], 1)])
        reference = full_logits(runner.model, ids[:length])[-1:]
        assert (logits - reference).abs().max() < ATOL, length


def test_the_lean_rms_norm_rounds_as_transformers_in_half_precision():
    """In bfloat16 the norm is taken in float32 and cast back before the weight multiplies,
    as transformers' Llama RMSNorm does: bit for bit the module's own output."""
    norm = tiny_llama(1).model.layers[0].input_layernorm.to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
        x = torch.randn(5, norm.weight.numel(), generator=torch.Generator().manual_seed(0)) \
            .to(torch.bfloat16)
        assert torch.equal(lean.RMSNorm(norm)(x), norm(x))
