"""The router's args (`applications[].args` of the "router" app in cluster/*.yaml)."""

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from deployments.pool_args import ModelPath
from deployments.reasoning import ReasoningParserName
from deployments.tool_parsers import ToolCallParserName
from engine.models import DEMO_TARGET
from speculative.options import (
    MAX_PLAIN_STEPS,
    MAX_SPECULATIVE_TOKENS,
    MAX_TREE_WIDTH,
    PipelinedDrafting,
    SpeculationDefaults,
    TreeShape,
)
from speculative.policy import KBounds


class SpeculativeTree(BaseModel):
    """A draft tree per round: a main chain `depth` deep (default: the request's K) and up to
    `width` children at its nodes (the drafter's next most likely tokens, or its draws
    without replacement), `nodes` in all. Width 1 is a chain. A request with a grammar or
    logit shaping drafts a chain, as does a pipelined round's pre-draft: a tree's rounds
    are sequential. "auto" instead of a shape: the adaptive K chooses per round between
    its chain and a tree of as many nodes (tree_shape)."""

    model_config = ConfigDict(extra="forbid")

    width: int = Field(default=2, ge=1, le=MAX_TREE_WIDTH)
    # a node beside the main chain, of the 64 at most (as the CLI's -k under --tree-width)
    depth: int | None = Field(default=None, ge=1, le=MAX_SPECULATIVE_TOKENS - 1)
    # the nodes in all, the main chain's included (default: width x depth, at most 64): the
    # other children go to the levels the draft expects them to pay at
    nodes: int | None = Field(default=None, ge=1, le=MAX_SPECULATIVE_TOKENS)

    def shape(self) -> TreeShape:
        return TreeShape(self.width, self.depth, self.nodes)

    @model_validator(mode="after")
    def room_beside_the_chain(self):
        if self.depth is not None and self.nodes is not None and self.nodes <= self.depth:
            raise ValueError(f"nodes ({self.nodes}) must exceed depth ({self.depth}): the "
                             "main chain alone is a chain (num_speculative_tokens)")
        return self


def bearer_key(key: str) -> str:
    """An API key a client can send as `Authorization: Bearer <key>` (the key itself is never
    quoted: it is a secret). Empty, it left the router open (read as no key); with whitespace
    at an end or a character outside printable ASCII, it is one clients do not send (HTTP
    servers strip a header's trailing whitespace, and clients send ASCII): every request a
    401."""
    if not key:
        raise ValueError("an empty API key: leave it unset for none")
    if key != key.strip() or not (key.isascii() and key.isprintable()):
        raise ValueError("an API key must be printable ASCII without whitespace at either end")
    return key


# the URI schemes gRPC resolves ("dns:///host:port"); it takes "http://host:port" for a
# host name "http://host", which no lookup finds
GRPC_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock")


def grpc_target(address: str) -> str:
    """Serve's gRPC proxy as `host:port` (or gRPC's `unix:` form). Without a port, gRPC dialled
    443, and with a URL's scheme (http://, grpc://) looked the scheme up as part of the host:
    every pool call failed UNAVAILABLE long after the deploy had succeeded."""
    host, colon, port = address.rpartition(":")
    scheme, slashes, _ = address.partition("://")
    if slashes and scheme not in GRPC_SCHEMES:
        raise ValueError(f"grpc_address {address!r}: gRPC resolves no {scheme}:// (give "
                         "host:port)")
    if address.startswith("unix:") or (host and colon and port.isdigit()
                                       and 1 <= int(port) <= 65535):
        return address
    raise ValueError(f"grpc_address {address!r} is not host:port (port in 1-65535)")


# a pool call's deadline goes to gRPC, which adds it to the wall clock in int64 nanoseconds:
# from about 7.4e9 s (the overflow less the seconds since 1970) every call failed
# DEADLINE_EXCEEDED at once, each request a 503. A day is far beyond any call's wait
MAX_DEADLINE_S = 86_400.0

TreeArg = SpeculativeTree | Literal["auto"]
# a served model name: empty, answers carried `model: ""` (and its card had no name)
ServedName = Annotated[str, Field(min_length=1)]
# a pool's Serve application, named in every gRPC call's metadata
AppName = Annotated[str, Field(min_length=1)]


def distinct_names(names):
    """served_model_name's names, each once (a repeated one listed its card twice)."""
    if isinstance(names, list) and len(set(names)) != len(names):
        raise ValueError("served_model_name lists a name more than once")
    return names


def tree_shape(tree: TreeArg | None) -> TreeShape | None:
    """The front end's shape of a `speculative_tree` value (None: unset)."""
    if tree is None:
        return None
    return TreeShape(auto=True) if tree == "auto" else tree.shape()


class AdaptiveKArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min: int = Field(default=0, ge=0, le=MAX_SPECULATIVE_TOKENS)  # 0: off when it cannot pay
    max: int = Field(default=8, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # the first round's K (default: the best under the prior and the costs measured so far)
    initial: int | None = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS)  # in [min, max]
    # the K of a seeded sampled request: an adaptive K follows timings and load, and the same
    # seed must give the same tokens (greedy output is the same whatever the K)
    seeded: int = Field(default=4, ge=0, le=MAX_SPECULATIVE_TOKENS)

    def bounds(self) -> KBounds:
        return KBounds(self.min, self.max, self.initial)

    @model_validator(mode="after")
    def ordered(self):
        self.bounds()  # raises ValueError unless 0 <= min <= max
        if self.initial is not None and not self.min <= self.initial <= self.max:
            raise ValueError(f"initial ({self.initial}) must lie within [min, max] "
                             f"({self.min}, {self.max})")
        return self


class ResponsesStoreArgs(BaseModel):
    """The bounds of the router's response store (deployments.response_store): the least
    recently used Response out past either bound, and each gone ttl_s after it was stored
    (OpenAI keeps them 30 days; this keeps them in memory, in one actor)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_entries: int = Field(default=10_000, ge=1)
    max_bytes: int = Field(default=256 << 20, ge=1)  # the Responses' and messages' JSON
    ttl_s: float = Field(default=24 * 3600.0, gt=0)


class RouterArgs(BaseModel):
    # (no infinite deadlines: nothing waits unbounded)
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    # the target checkpoint: its end tokens, context length and vocabulary (no weights loaded)
    model: ModelPath = DEMO_TARGET
    tokenizer: ModelPath | None = None  # default: the model's (the pools only see token ids)
    # the name requests give as `model`, or several (vLLM's --served-model-name): a request
    # may give any (or none), /v1/models lists each, and answers carry the first
    served_model_name: Annotated[ServedName | Annotated[list[ServedName], Field(min_length=1)],
                                 AfterValidator(distinct_names)] = "specserve-demo"
    grpc_address: Annotated[str, AfterValidator(grpc_target)] = "127.0.0.1:9000"  # Serve's proxy
    drafter_app: AppName = "drafter"
    verifier_app: AppName = "verifier"
    # K drafted per round, or "auto": per request, the K in adaptive_k's bounds that the
    # request's acceptance and the measured costs (the verifier's load among them) say is
    # fastest (a request may say either; a fixed K is kept whatever the load)
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | \
        Literal["auto"] = "auto"
    adaptive_k: AdaptiveKArgs = AdaptiveKArgs()
    # draft the next block while the verifier scores this one, and a fresh one beside the
    # verify after a rejection: "on" (measured, it pays greedy and sampled), "greedy"
    # (greedy requests only) or "off"; a request may say otherwise with "pipelined"
    pipelined_drafting: PipelinedDrafting = "on"
    # a draft tree per round for requests that name none ({"width": b, "depth": d}, or
    # "auto": chosen per round against the chain by their yields, for requests with an
    # adaptive K and no pipelining; a request may say otherwise with "speculative_tree");
    # None: chains
    speculative_tree: TreeArg | None = None
    # the draft calls' draft_confidence: a model drafter's block ends once the product of its
    # drafted tokens' probabilities falls below it; "auto": learnt from acceptance and the
    # measured costs, for requests with an adaptive K and no pipelining (pipelined ones
    # leave it to the pool: speculative.confidence); None: the drafter pool's own (its
    # `draft_confidence`, 0 = off, by default). At most 0.999: the wire's float32 rounds
    # what is closer to 1 up to 1, which a drafter refuses
    draft_confidence: Annotated[float, Field(ge=0, le=0.999)] | Literal["auto"] | None = None
    # "auto" (as vLLM's --generation-config): a request that leaves temperature, top_p,
    # top_k, min_p or repetition_penalty unset gets the target's generation_config.json's
    # (checked at start); "vllm": OpenAI's neutral defaults whatever the checkpoint says
    generation_config: Literal["auto", "vllm"] = "auto"
    # completions without max_tokens (OpenAI's default); chat without max_tokens may use
    # the rest of the context, as vLLM's does
    default_max_tokens: int = Field(default=16, ge=1)
    # vLLM's --reasoning-parser: a chat output's text inside `<think>...</think>` goes out as
    # the message's `reasoning` (streamed: the deltas'), the rest as its content (the tokens,
    # usage and logprobs stay the output's own: deployments.reasoning); None: off, as vLLM
    reasoning_parser: ReasoningParserName | None = None
    # vLLM's --structured-outputs-config.enable_in_reasoning: under a reasoning_parser, a
    # grammar holds from the output's first token (none waits for the reasoning's end: the
    # grammar must allow the thinking itself); the text is split as without it
    # (deployments.reasoning.grammar_gate)
    structured_outputs_enable_in_reasoning: bool = False
    # vLLM's --tool-call-parser: the format an "auto" chat output's calls are read in
    # (deployments.tool_parsers): "hermes" (`<tool_call>{...}</tool_call>`, the demo's),
    # "llama3_json" (Llama 3's bare JSON with "parameters"), "mistral" (`[TOOL_CALLS]`),
    # "pythonic" (a Python list of calls, `[f(x=1)]`: Llama 3.2's with vLLM's pythonic
    # template, Llama 4's); a forced call is written and read in Hermes' format whatever
    # this says
    tool_call_parser: ToolCallParserName = "hermes"
    # default: the model's max_position_embeddings (engine.checkpoint.context_limit)
    max_context_tokens: int | None = Field(default=None, ge=2)
    # a pool call's deadline: the verifier's (and the drafter's for seeded sampled
    # requests, whose tokens depend on their drafts); past it the request answers 503
    call_timeout_s: float = Field(default=30.0, gt=0, le=MAX_DEADLINE_S)
    # the drafter's deadline for everyone else: past it (or when the drafter fails) the
    # round runs without a draft, exact, and the request's next rounds skip the drafter a
    # while (speculative.busy.DraftBackoff)
    draft_timeout_s: float = Field(default=1.0, gt=0, le=MAX_DEADLINE_S)
    # a request whose verifier has no room for it (its KV cache or its calls in flight full:
    # RESOURCE_EXHAUSTED) retries the same round after doubling pauses for up to this long
    # (speculative.busy), then gets 429 (streamed: an error event); 0: 429 at once
    busy_wait_s: float = Field(default=30.0, ge=0)
    # a round without a draft (K = 0: speculation off, or chosen by the adaptive K under
    # load) asks the verifier for up to this many tokens: it draws and feeds each itself,
    # and the round's calls and turn are paid once for them all (verifier.steps; as vLLM's
    # num_scheduler_steps). Its tokens then stream this many at a time
    plain_steps: int = Field(default=4, ge=1, le=MAX_PLAIN_STEPS)
    direct_data_path: bool = True  # after Serve places a request, call its replicas directly
    # ...over one stream per pool replica, each message carrying every call waiting for it
    # (false: one unary call per call, as before the streams; for comparison)
    direct_streams: bool = True
    # a request's first call is placed by the hash of its prompt's first this many tokens,
    # so requests that start alike share a replica's prefix cache (a hint; a prompt shared
    # by most traffic then lands on one replica per pool); 0: placed by request id only
    prefix_affinity_tokens: int = Field(default=32, ge=0)
    # ...while that replica holds fewer than this factor times its share of the requests
    # this router has on the pool (bounded-load hashing: deployments.placement); beyond, a
    # request goes to the least loaded replica. None (or direct_data_path false): by the
    # prefix alone, however many
    prefix_affinity_load_factor: float | None = Field(default=1.25, ge=1)
    # admission: choices (n counts) running at once in this replica; a request whose
    # choices do not fit waits its turn, first come first served (deployments.admission; a
    # request of more choices than this gets 400). Keep replicas x this within the pools'
    # session and token bounds (max_cached_requests, max_cached_tokens), so that running
    # requests are never evicted from the caches
    max_running_requests: int = Field(default=128, ge=1)
    # the committed tokens the sessions of each drafter the router runs itself (a request's
    # "drafter": "ngram" or "suffix") hold together, least recently used out beyond it (an
    # evicted session rebuilds on its next call, exact): a suffix drafter's tries take about
    # 6 KB a token, so 1.5 GB at worst here. Keep max_running_requests x the context within
    # it, as the pools' max_cached_tokens
    local_drafter_cached_tokens: int = Field(default=262_144, ge=1)
    # requests (not choices) waiting for their turn in this replica; beyond it a request
    # gets 429 with Retry-After at once (0: none waits). The waiting hold Serve's slots on
    # the router (its max_ongoing_requests): keep those above max_running_requests + this,
    # or Serve's own queue, and its 503, fills first
    max_waiting_requests: int = Field(default=128, ge=0)
    # vLLM's --scheduling-policy: "fcfs", the waiting in arrival order (a request's
    # `priority` other than 0 is then a 400, as vLLM's), or "priority", by the requests'
    # `priority` (lower first), then arrival; running requests are never preempted
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_prompt_bytes: int = Field(default=1 << 20, ge=1)  # checked before tokenizing
    # a bearer key /v1/* require (Authorization: Bearer <key>); default: the environment's
    # SPECSERVE_API_KEY, else none (open, as the embedded config on 127.0.0.1 is)
    api_key: Annotated[str, AfterValidator(bearer_key)] | None = None
    # CORS, vLLM's flags with its defaults: the origins whose pages a browser lets call the
    # API ("*": any), the methods and headers their requests may use, and whether they may
    # send credentials (cookies, Authorization; then an allowed origin is echoed, never "*")
    allowed_origins: list[str] = ["*"]
    allowed_methods: list[str] = ["*"]
    allowed_headers: list[str] = ["*"]
    allow_credentials: bool = False
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info answers the tokenizer's
    # config, its chat template among it (off, as vLLM: a template may be private); off: 404
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's --trust-request-chat-template: a chat (and /tokenize's chat) may bring its own
    # chat template (`chat_template`), rendered in transformers' sandboxed Jinja environment
    # on the router's tokenizing thread; off, such a request is refused (400), as vLLM's. The
    # sandbox keeps a template from Python's internals, not from CPU or memory (a loop in a
    # loop, a text repeated a billion times): turn it on for trusted clients only
    trust_request_chat_template: bool = False
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: /v1/responses stores each Response (unless
    # the request says `store: false`) and the conversation it continued, in one Ray actor
    # per application that every router replica calls, so that a request's
    # previous_response_id continues it and GET /v1/responses/{id} returns it; bounded by
    # these args ({} for their defaults). None (off, as vLLM): previous_response_id is
    # refused (400), nothing is stored and GET answers 404
    responses_store: ResponsesStoreArgs | None = None

    def cross_origin(self) -> dict:
        """Starlette's CORSMiddleware's arguments (deployments.ingress.allow_cross_origin)."""
        return {"allow_origins": self.allowed_origins, "allow_methods": self.allowed_methods,
                "allow_headers": self.allowed_headers,
                "allow_credentials": self.allow_credentials}

    def speculation_defaults(self) -> SpeculationDefaults:
        """What the request front end gives a request for the fields it leaves unset."""
        return SpeculationDefaults(self.num_speculative_tokens, self.adaptive_k.bounds(),
                                   self.adaptive_k.seeded, self.pipelined_drafting,
                                   self.busy_wait_s,
                                   tree_shape(self.speculative_tree) or TreeShape(),
                                   self.draft_confidence, self.plain_steps)


def response_store(args: ResponsesStoreArgs | None):
    """The deployed router's store, as its `responses_store` args bound it (None: off):
    the actor of this replica's Serve application, shared by its replicas."""
    if args is None:
        return None
    from ray import serve

    from deployments.store_actor import ActorStore

    application = serve.get_replica_context().app_name
    store = ActorStore(f"specserve-responses-{application}", args.max_entries,
                       args.max_bytes, args.ttl_s)
    store.wait_started()  # its worker up before the replica is (by the first request's call)
    return store
