"""The loop's Drafter and Verifier over gRPC: each pool's calls as its PoolClient
(deployments.clients) places them, their messages as deployments.wire writes them, and a
drafter's failures logged (a round without its draft runs the target alone)."""

import functools

import grpc

from deployments import wire
from deployments.clients import PoolClient
from deployments.health import FailureLog
from deployments.placement import (
    ROUTE_PREFIX_TOKENS,
    LoadBound,
    prefix_route_key,
    running_replicas,
)
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.types import (
    DraftBlock,
    PoolUnavailable,
    PromptLogprobs,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TargetScores,
)

# a drafter whose calls keep failing (its app down or misnamed, its pool full, its drafts
# late) turns rounds into the target's alone, which only a counter showed: the router says
# so in its log, at most this often
DRAFT_FAILURES_LOGGED_EVERY_S = 60.0


class GrpcDrafter:
    """timeout_s: a seeded sampled request's deadline; draft_timeout_s: everyone else's."""

    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float,
                 direct: bool = True, draft_timeout_s: float | None = None,
                 streams: bool = True, prefix_tokens: int = ROUTE_PREFIX_TOKENS,
                 options: list | None = None, bound: LoadBound | None = None) -> None:
        self.pool = PoolClient(channel, pb_grpc.DrafterStub, application, timeout_s, direct,
                               streams, options, bound)
        self.draft_timeout_s = draft_timeout_s or timeout_s
        self.prefix_tokens = prefix_tokens
        self.failures = FailureLog(f"calls to the drafter app {application!r} failed or "
                                   "were refused (a round without its draft runs the target "
                                   "alone)", DRAFT_FAILURES_LOGGED_EVERY_S)

    async def propose(self, call: ProposeCall) -> DraftBlock:
        message = wire.propose_to_proto(call)
        try:
            response = await self.pool.call("Propose", message, call.request_id,
                                            None if call.sampling.seeded else
                                            self.draft_timeout_s,
                                            prefix_route_key(call.request_id, call.sync,
                                                             self.prefix_tokens, call.placement,
                                                             call.cache_key),
                                            call.placement or None)
        except PoolUnavailable as error:
            self.failures.failure(error)
            raise
        if response.status == pb.REBUILD:
            raise StaleBase(f"drafter replica {response.replica_id} asks for the full prefix")
        try:
            return wire.block_from_proto(response, message.ByteSize() + response.ByteSize())
        except ValueError as error:  # a drafter's bad answer costs its draft, not the request
            failure = PoolUnavailable(f"drafter: malformed answer: {error}")
            self.failures.failure(failure)
            raise failure from None

    async def release(self, request_id: str) -> None:
        self.pool.release(request_id)


class GrpcVerifier:
    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float,
                 direct: bool = True, streams: bool = True,
                 prefix_tokens: int = ROUTE_PREFIX_TOKENS, options: list | None = None,
                 bound: LoadBound | None = None) -> None:
        self.pool = PoolClient(channel, pb_grpc.VerifierStub, application, timeout_s, direct,
                               streams, options, bound)
        self.prefix_tokens = prefix_tokens

    async def score(self, call: ScoreCall) -> TargetScores:
        message = wire.score_to_proto(call)
        response = await self.pool.call("Score", message, call.request_id,
                                        route_key=prefix_route_key(
                                            call.request_id, call.sync, self.prefix_tokens,
                                            call.placement, call.cache_key),
                                        spill_key=call.placement or None)
        if response.status == pb.REBUILD:
            raise StaleBase(f"verifier replica {response.replica_id} asks for the full prefix")
        return gated(call, wire.scores_from_proto(response,
                                                  message.ByteSize() + response.ByteSize()))

    async def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    async def prompt_logprobs(self, request_id: str, token_ids: list[int],
                              top_n: int) -> PromptLogprobs:
        """The prompt's logprobs, through the proxy (no session: any replica serves it)."""
        message = pb.PromptLogprobsRequest(request_id=request_id, token_ids=token_ids,
                                           top_n=top_n)
        response = await self.pool.unplaced("PromptLogprobs", message, request_id)
        return wire.prompt_logprobs_from_proto(response, token_ids)


def gated(call: ScoreCall, scores: TargetScores) -> TargetScores:
    """scores, unless the call's grammar holds after the reasoning and the verifier did not
    say it masked so: one that predates the gate (SamplingParams field 18, which it ignores)
    applies the grammar from the output's first token, and one that predates the implicit
    ends (field 19) waits for the end ids alone: laws other than the request's."""
    if call.sampling.grammar_after and not scores.grammar_gated:
        raise PoolUnavailable("verifier: applied the grammar from the output's first token, "
                              "not after the reasoning (a version without the grammar's "
                              "gate?): serve both pools from one version")
    if call.sampling.grammar_at and not scores.grammar_at_gated:
        raise PoolUnavailable("verifier: did not end the reasoning at its implicit end (a "
                              "version without grammar_at_ids?): serve both pools from one "
                              "version")
    return scores


def pool_clients(channel, args, channel_options) -> tuple[GrpcDrafter, GrpcVerifier]:
    """The router's clients of its two pools over `channel` (args: RouterArgs)."""
    timeout, direct, streams = args.call_timeout_s, args.direct_data_path, args.direct_streams
    placed_by = args.prefix_affinity_tokens
    drafter = GrpcDrafter(channel, args.drafter_app, timeout, direct, args.draft_timeout_s,
                          streams, placed_by, channel_options,
                          load_bound(args, args.drafter_app))
    verifier = GrpcVerifier(channel, args.verifier_app, timeout, direct, streams, placed_by,
                            channel_options, load_bound(args, args.verifier_app))
    return drafter, verifier


def load_bound(args, application: str) -> LoadBound:
    """How requests of a hot prefix spread over a pool's replicas (deployments.placement),
    the pool's replica count read from Serve."""
    return LoadBound(args.prefix_affinity_load_factor,
                     functools.partial(running_replicas, application))
