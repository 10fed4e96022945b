"""Every kind of drafter, in one table: the CLI, the drafter pool and the router build
drafters from it, so a new drafter is one file plus one entry here.

A kind is built from a `DrafterSpec`. Kinds without a model (`needs_model` False) are cheap
enough to run beside the router too, where a request may ask for one by name.
"""

from collections.abc import Callable
from dataclasses import dataclass

from engine.checkpoint import Checkpoint, check_same_tokenizer, check_vocabularies
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer


@dataclass(frozen=True)
class DrafterSpec:
    kind: str = "model"
    model: str = DEMO_DRAFT  # the draft checkpoint (kinds that need a model)
    target: str = DEMO_TARGET  # the target checkpoint: the vocabulary the pools agree on
    dtype: str = "float32"
    device: str = "cpu"
    max_cached_requests: int = 256
    max_cached_tokens: int | None = None  # see deployments.pool_args.PoolArgs
    session_ttl_s: float | None = None
    engine: str = "auto"  # see deployments.pool_args.PoolArgs
    attention: str = "auto"
    cuda_graphs: bool = True
    kv_cache_tokens: int | None = None
    # model: q as shipped: its top entries (0 = all), the fewest top entries holding this
    # mass (1 = all), in this precision. Whole in float32 by default (float16's steps move
    # residual draws where q is close to p whenever the drafter's rounding changes, so a
    # seeded request's tokens followed its batches; the demo draft's rows are flat, so
    # truncating saved no bytes and cost 0.3 ms a drafted token); a large
    # vocabulary wants a mass of 0.99 (cluster/gpu.yaml: under 0.01 of acceptance lost per
    # position, measured at K = 1..8, about 6 KB a drafted position).
    draft_top_k: int = 0
    draft_q_mass: float = 1.0
    draft_q_dtype: str = "float32"
    # model: end a block once its drafted tokens' probabilities multiplied fall below this
    # (0: every block K tokens); drafter.model.ModelDrafter
    draft_confidence: float = 0.0
    # model: the tokens a batch's first forward feeds; a longer feed goes on in the next
    # batches (chunked prefill, as the verifier's); None: no bound (in process)
    max_batch_tokens: int | None = None
    ngram_min: int = 1  # ngram: shortest suffix looked up
    ngram_max: int = 4  # ngram: longest suffix looked up


@dataclass(frozen=True)
class DrafterKind:
    build: Callable[[DrafterSpec, Checkpoint], object]  # (spec, target) -> a Drafter engine
    needs_model: bool
    help: str


def grammar_tokenizer(spec: DrafterSpec, target: Checkpoint):
    """The target's tokenizer as the grammars read it. Imported here, not with the registry:
    the pool apps' args name DrafterSpec's defaults, and an app build imports no torch."""
    from speculative.grammar import grammar_tokenizer_at

    return grammar_tokenizer_at(spec.target, target.vocab_size)


def build_model_drafter(spec: DrafterSpec, target: Checkpoint):
    from drafter.model import ModelDrafter

    draft = Checkpoint.load(spec.model)
    target_tokenizer = load_tokenizer(spec.target)
    check_vocabularies(draft, target, len(target_tokenizer))
    try:
        draft_tokenizer = load_tokenizer(spec.model)
    except (OSError, ValueError):  # a draft folder without a tokenizer uses the target's
        draft_tokenizer = None
    if draft_tokenizer is not None:
        check_same_tokenizer(draft_tokenizer, target_tokenizer, spec.model, spec.target)
    model = load_causal_lm(spec.model, spec.dtype, spec.device)
    return ModelDrafter(model, vocab_size=target.vocab_size, draft_top_k=spec.draft_top_k,
                        draft_q_mass=spec.draft_q_mass, draft_q_dtype=spec.draft_q_dtype,
                        max_cached_requests=spec.max_cached_requests,
                        max_cached_tokens=spec.max_cached_tokens,
                        session_ttl_s=spec.session_ttl_s, engine=spec.engine,
                        attention=spec.attention, cuda_graphs=spec.cuda_graphs,
                        kv_cache_tokens=spec.kv_cache_tokens,
                        grammar_tokenizer=grammar_tokenizer(spec, target),
                        draft_confidence=spec.draft_confidence,
                        max_batch_tokens=spec.max_batch_tokens)


def build_ngram_drafter(spec: DrafterSpec, target: Checkpoint):
    from drafter.ngram import NgramDrafter

    return NgramDrafter(target.vocab_size, min_ngram=spec.ngram_min, max_ngram=spec.ngram_max,
                        max_cached_requests=spec.max_cached_requests,
                        max_cached_tokens=spec.max_cached_tokens,
                        session_ttl_s=spec.session_ttl_s,
                        grammar_tokenizer=grammar_tokenizer(spec, target))


def build_suffix_drafter(spec: DrafterSpec, target: Checkpoint):
    from drafter.suffix import SuffixDrafter

    return SuffixDrafter(target.vocab_size, max_cached_requests=spec.max_cached_requests,
                         max_cached_tokens=spec.max_cached_tokens,
                         session_ttl_s=spec.session_ttl_s,
                         grammar_tokenizer=grammar_tokenizer(spec, target))


DRAFTERS: dict[str, DrafterKind] = {
    "model": DrafterKind(build_model_drafter, needs_model=True,
                         help="a small causal LM sharing the target's tokenizer"),
    "ngram": DrafterKind(build_ngram_drafter, needs_model=False,
                         help="prompt lookup: what followed the latest n-gram in the context"),
    "suffix": DrafterKind(build_suffix_drafter, needs_model=False,
                          help="suffix decoding: the most frequent continuation of the context's "
                               "longest earlier suffix, in the request and in recent outputs"),
}


def build_drafter(spec: DrafterSpec, target: Checkpoint | None = None):
    """The drafter engine of spec.kind, checked against the target at start-up."""
    if spec.kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {sorted(DRAFTERS)}, got {spec.kind!r}")
    if spec.draft_top_k < 0:
        raise ValueError(f"draft_top_k must be >= 0, got {spec.draft_top_k}")
    if not 0 < spec.draft_q_mass <= 1:
        raise ValueError(f"draft_q_mass must be in (0, 1], got {spec.draft_q_mass}")
    if spec.draft_q_dtype not in ("float32", "float16"):
        raise ValueError(f"draft_q_dtype must be float32 or float16, got {spec.draft_q_dtype!r}")
    return DRAFTERS[spec.kind].build(spec, target or Checkpoint.load(spec.target))


def router_side_kinds() -> list[str]:
    """Kinds a request may ask the router to run itself (no model to load)."""
    return [name for name, kind in DRAFTERS.items() if not kind.needs_model]
