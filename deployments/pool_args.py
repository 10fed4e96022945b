"""`applications[].args` of the drafter and verifier pool apps (deployments.pools)."""

from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, field_validator,
                      model_validator)

from drafter.registry import DRAFTERS, DrafterSpec
from engine.models import DEMO_DRAFT, DEMO_TARGET, DTYPES, expand_home

# a replica's warm-up before it reports ready: a prompt of this many tokens, then a K-token
# step (deployments.pools.PoolReplica.warm_up)
WARM_UP_PROMPT_TOKENS = 16
WARM_UP_K = 4

# a hub id or a folder ("~" expanded); empty (an unset variable templated in), each replica's
# start failed on transformers' "Repo id must use alphanumeric chars", naming no arg
ModelPath = Annotated[str, Field(min_length=1), AfterValidator(expand_home)]


class PoolArgs(BaseModel):
    """`applications[].args` of a pool app; unknown keys are errors."""

    # no infinite durations (as the router's): an idle session that never expires holds its
    # KV until evicted, and a stall never noticed leaves calls waiting on a dead worker
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    model: ModelPath
    # one of torch's dtypes the pools load: refused at deploy, not after a replica has
    # fetched the weights
    dtype: Literal[DTYPES] = "float32"
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")  # cpu, cuda, cuda:N
    torch_threads: int = Field(default=1, ge=1)  # match the replica's num_cpus
    max_cached_requests: int = Field(default=256, ge=1)
    # cached tokens over all sessions (prompt and output): least recently used sessions are
    # evicted beyond it (they rebuild once, exact); size it for the router's admission
    max_cached_tokens: int = Field(default=262_144, ge=1)
    session_ttl_s: float = Field(default=600.0, gt=0)  # an idle session is dropped after it
    # the forward: "paged" (engine.paged: a block-paged KV cache, one attention call per
    # layer; Llama, Mistral, Qwen2), "transformers" (its modeling, a DynamicCache per
    # request), "auto" (paged where the architecture allows)
    engine: Literal["auto", "paged", "transformers"] = "auto"
    # the lean forward's attention backend (engine.runner): "regions" (each request's keys
    # read in place; the CPU default where memory holds enough whole-context regions),
    # "paged" (blocks gathered: the reference, the GPU default), "auto"
    attention: Literal["auto", "paged", "regions"] = "auto"
    # on a GPU, small batches of the paged backend replay CUDA graphs, one per batch bucket
    # (engine.graphs); false runs every forward kernel by kernel (vLLM's enforce_eager)
    cuda_graphs: bool = True
    # positions the paged KV pool holds, drafted ones included, in whole blocks (default: on
    # a GPU its free memory less 10 %, on a CPU 30 % of the memory available at start, backed
    # by memory only as blocks are used; too little for one request at the model's context
    # is an error). The regions backend rounds it up to whole-context regions, two at least.
    # At least the start's warm-up call (fewer: every start of the replica failed)
    kv_cache_tokens: int | None = Field(default=None, ge=WARM_UP_PROMPT_TOKENS + WARM_UP_K)
    # calls that share one forward: those arriving while the model is busy join the next
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    # tokens per forward: a longer prefill is fed in chunks over several forwards, each
    # shared with the decodes (verifier) or drafts (drafter) that arrive meanwhile (chunked
    # prefill); none: no bound. A drafter without a model ignores it
    max_batch_tokens: int | None = Field(default=512, ge=16)
    # under load, a batch may wait for the requests of the previous batch to come back, up
    # to this fraction of the previous forward's time (at most 10 ms; 0: never waits), so
    # that the requests do not split into groups that take turns (deployments.batcher)
    batch_linger: float = Field(default=0.5, ge=0)
    # calls in flight on the replica's own gRPC port (unary calls and stream entries alike);
    # beyond it a call is answered RESOURCE_EXHAUSTED at once (default: twice max_batch_size);
    # also the port's rpcs (streams, Releases: a refused Release is tried again); at most
    # gRPC's bound (a C int: beyond it the replica's start failed naming no arg)
    max_concurrent_rpcs: int | None = Field(default=None, ge=1, le=2**31 - 1)
    # where the replica's own gRPC port listens: "loopback" (127.0.0.1: one machine) or
    # "node" (the node's cluster-internal address: routers on other nodes); either way every
    # call must carry the pool secret (deployments.auth)
    direct_host: Literal["loopback", "node"] = "loopback"
    # a replica whose model worker has not finished a batch for this long while calls wait
    # (or has run one batch this long), or whose engine has failed every batch this long,
    # fails its health check, and Serve replaces it (deployments.health)
    health_stall_s: float = Field(default=60.0, gt=0)


class DrafterArgs(PoolArgs):
    model: ModelPath = DEMO_DRAFT
    target: ModelPath = DEMO_TARGET  # the verifier's checkpoint: the vocabulary both pools agree on
    drafter: str = "model"  # a kind of drafter.registry.DRAFTERS
    # q as shipped (drafter.registry.DrafterSpec): top entries (0 = all), the fewest top
    # entries holding this mass (1 = all), precision
    draft_top_k: int = Field(default=DrafterSpec.draft_top_k, ge=0)
    draft_q_mass: float = Field(default=DrafterSpec.draft_q_mass, gt=0, le=1)
    draft_q_dtype: Literal["float32", "float16"] = DrafterSpec.draft_q_dtype
    # end a block once its drafted tokens' probabilities multiplied fall below this (0: off)
    draft_confidence: float = Field(default=DrafterSpec.draft_confidence, ge=0, lt=1)
    ngram_min: int = Field(default=1, ge=1)
    ngram_max: int = Field(default=4, ge=1)

    @field_validator("drafter")
    @classmethod
    def known_drafter(cls, kind: str) -> str:
        if kind not in DRAFTERS:
            raise ValueError(f"must be one of {sorted(DRAFTERS)}, got {kind!r}")
        return kind

    @model_validator(mode="after")
    def ngram_order(self):
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max "
                             f"({self.ngram_max})")
        return self

    def spec(self) -> DrafterSpec:
        return DrafterSpec(kind=self.drafter, model=self.model, target=self.target,
                           dtype=self.dtype, device=self.device,
                           max_cached_requests=self.max_cached_requests,
                           max_cached_tokens=self.max_cached_tokens,
                           session_ttl_s=self.session_ttl_s, engine=self.engine,
                           attention=self.attention, cuda_graphs=self.cuda_graphs,
                           kv_cache_tokens=self.kv_cache_tokens,
                           draft_top_k=self.draft_top_k, draft_q_mass=self.draft_q_mass,
                           draft_q_dtype=self.draft_q_dtype,
                           draft_confidence=self.draft_confidence,
                           max_batch_tokens=self.max_batch_tokens, ngram_min=self.ngram_min,
                           ngram_max=self.ngram_max)


class VerifierArgs(PoolArgs):
    model: ModelPath = DEMO_TARGET
