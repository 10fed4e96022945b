"""The drafter and verifier pools: the replicas of two thin Serve deployments (deployments.apps)
serving specserve.proto.

Serve's gRPC proxy calls the method named like the rpc with the decoded request message; each
replica also serves the same servicer methods on its own gRPC port (`direct_address` in every
answer), which the router uses once Serve has placed a request. A malformed request answers
INVALID_ARGUMENT; a call whose base the replica does not hold answers status REBUILD (the
router resends the whole prefix).
"""

import asyncio
import time

import grpc
import torch

from deployments import auth, wire
from deployments.batcher import ContinuousBatcher
from deployments.health import BatchHealth
from deployments.limits import (
    Limits,
    check_prompt_logprobs,
    check_propose,
    check_request_id,
    check_score,
    in_messages,
)
from deployments.streams import CallStream, is_direct, serve_directly
from deployments.pool_worker import EngineWorker
from deployments.metrics import PoolMetrics
from deployments.autoscaling import Occupancy
from deployments.pool_args import (WARM_UP_K, WARM_UP_PROMPT_TOKENS, DrafterArgs, PoolArgs,
                                   VerifierArgs)
from deployments.pool_replies import ReplicaReports, Unserved, refuse, replica_id, unauthenticated
from deployments.released import Released
from drafter.registry import build_drafter
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from engine.checkpoint import Checkpoint
from engine.models import load_causal_lm
from engine.batch import UNFINISHED, run_alone
from engine.kv import PoolEngine
from engine.scheduler import KVCacheTooSmall
from engine.cache import KVCacheFull
from speculative.grammar import grammar_tokenizer_at
from speculative.prefixes import EMPTY_PREFIX_HASH, prefix_hash
from speculative.token_masks import GrammarDeadEnd
from speculative.sampling import SamplingParams
from speculative.types import (
    PrefixSync,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TreesUnsupported,
)
from verifier.engine import ModelVerifier
from verifier.prompt_scores import PromptScoring

# a refused call's status, by its error (the first that matches)
REFUSALS = ((KVCacheTooSmall, grpc.StatusCode.OUT_OF_RANGE),  # the request never fits here
            (GrammarDeadEnd, grpc.StatusCode.OUT_OF_RANGE),  # nor can its grammar go on
            (TreesUnsupported, grpc.StatusCode.OUT_OF_RANGE),  # nor its trees be scored here
            (KVCacheFull, grpc.StatusCode.RESOURCE_EXHAUSTED),  # other requests hold the blocks
            (ValueError, grpc.StatusCode.INVALID_ARGUMENT))


class PoolReplica(EngineWorker, ReplicaReports):
    """What both pools share: the direct server, batching, answering a call, release,
    introspection.

    Calls, from Serve's proxy or the direct port alike, queue for the replica's batcher:
    whatever has arrived while the model was busy runs as one batch (one forward per step
    for all its calls, `engine.batch`), on one worker thread (deployments.pool_worker), so
    the event loop stays free for gRPC, health checks and metrics, and calls waiting for the
    model are visible as in flight.
    """

    engine: PoolEngine  # set by the subclass before start()

    async def start(self, add_to_server, run_batch, args: PoolArgs, pool: str,
                    limits: Limits) -> None:
        """run_batch: the engine's list of calls -> list of answers (or their refusals);
        limits: what a call may ask (checked before it is decoded or queued)."""
        max_batch_size = args.max_batch_size
        self.limits = limits
        self.secret = auth.pool_secret()  # resolved now: a missing Ray KV fails the start
        self.replica_id = replica_id()
        # each session's sampling parameters, sent once (wire.SessionSampling)
        self.sampling = wire.SessionSampling(4 * args.max_cached_requests)
        self.released = Released()  # for a call its request's Release overtook
        self.direct_calls = 0  # served over the replica's own port, ever
        self.direct_in_flight = 0  # the same, now: Serve's autoscaler cannot see these
        self.occupancy = Occupancy(max_batch_size)
        self.open_worker()
        self.metrics = PoolMetrics(pool)

        self.waiting = 0  # calls submitted and not answered
        self.health = BatchHealth(args.health_stall_s,
                                  tuple(kind for kind, _ in REFUSALS) + (StaleBase,))

        async def in_batch(calls: list) -> list:
            self.occupancy.observe(len(calls))
            self.metrics.record_batch(len(calls), max_batch_size)
            with self.health.batch(calls):
                return await self.run_engine(run_batch, calls)

        self.batcher = ContinuousBatcher(in_batch, max_batch_size,
                                         lambda answer: answer is UNFINISHED,
                                         key=lambda call: call.request_id,
                                         linger=args.batch_linger,
                                         idle=self.metrics.record_idle)
        # before the replica reports ready: no request pays the model's first forwards
        await self.on_worker(self.warm_up, run_batch, limits.vocab_size)
        self.max_direct_calls = args.max_concurrent_rpcs or 2 * max_batch_size
        self.server, self.address = await serve_directly(
            self, add_to_server, args.direct_host, self.max_direct_calls,
            limits.stream_message_bytes())

    def warm_up(self, run_batch, vocab_size: int) -> None:
        """Run the engine on throwaway greedy and sampled calls (a prompt's prefill, then a
        K-token step), on the worker thread that will serve, then drop their caches."""
        prompt = tuple(i % vocab_size for i in range(1, WARM_UP_PROMPT_TOKENS + 1))
        for index, params in enumerate((SamplingParams(temperature=0.0),
                                        SamplingParams(temperature=1.0))):
            request_id = f"warm-up-{index}"
            for call in self.warm_up_calls(request_id, prompt, params):
                try:
                    run_alone(run_batch, call)
                except KVCacheTooSmall as error:  # every request would be refused alike
                    raise KVCacheTooSmall(f"kv_cache_tokens too small: the warm-up's {error}") \
                        from None
            self.engine.sessions.release(request_id)

    def warm_up_calls(self, request_id: str, prompt: tuple[int, ...], params) -> list:
        raise NotImplementedError

    async def check_health(self) -> None:
        """Serve's periodic health check: fail (Serve then replaces the replica) when the
        model worker is stuck or its engine dead (deployments.health); its gauges set again
        (occupancy; the KV cache's use and sessions as last read with the engine, never
        waiting for the worker; the direct calls in flight now), which Ray's agent would drop
        if they held still (deployments.metrics)."""
        self.metrics.refresh(self.direct_in_flight)
        self.health.check(self.waiting)

    async def answer(self, check, call_from_proto, request, to_proto, response_type,
                     grpc_context):
        """A unary call's answer (Serve's proxy): to_proto(the call's answer in a batch), or a
        refusal as `respond` maps it; no pool secret -> UNAUTHENTICATED."""
        if not auth.authorized(grpc_context):
            return unauthenticated(grpc_context, response_type())
        future = self.submit(check, call_from_proto, request, is_direct(grpc_context))
        try:
            result = await future
        except ValueError as error:  # the batch failed on bad input
            result = error
        response, code = self.respond(result, to_proto, response_type)
        if code is not None:
            return refuse(grpc_context, result, response, code)
        return response

    def submit(self, check, call_from_proto, request, direct: bool) -> asyncio.Future:
        """The future of the call `request` decodes to, queued for the batcher: check(request,
        limits) or decoding failing -> its ValueError as the result, before the call queues;
        a call without sampling parameters whose session's are not held, or one its
        request's Release overtook (deployments.released) -> StaleBase.
        Counted as waiting (and in flight, when direct) until the future is done; a call
        whose decoding raised anything else (a bug) is counted nowhere."""
        try:
            check(request, self.limits)
            if self.released.refuses(request.request_id):
                raise StaleBase(f"request {request.request_id!r} was released")
            call = call_from_proto(request, self.sampling.of(request))
        except (ValueError, StaleBase) as error:  # refused before it reached the engine
            future = asyncio.get_running_loop().create_future()
            future.set_result(error)
        else:
            future = self.batcher.enqueue(call)
        # an idle worker is not a stalled one; a refusal too counts as waiting until its done
        # callback runs, and a health check may come first
        if not self.waiting:
            self.health.idle()
        self.direct_calls += direct
        self.direct_in_flight += direct
        self.waiting += 1

        def done(_) -> None:
            self.direct_in_flight -= direct
            self.waiting -= 1

        future.add_done_callback(done)
        return future

    def respond(self, result, to_proto, response_type) -> tuple[object, grpc.StatusCode | None]:
        """(the response, None) for an answer, or (a bare response, the status code) for a
        refusal: StaleBase -> status REBUILD (an answer); KVCacheTooSmall -> OUT_OF_RANGE;
        another ValueError -> INVALID_ARGUMENT; KVCacheFull -> RESOURCE_EXHAUSTED. Any other
        exception is raised."""
        for kind, code in REFUSALS:
            if isinstance(result, kind):
                return response_type(replica_id=self.replica_id), code
        if isinstance(result, StaleBase):
            response = response_type(status=pb.REBUILD)
        elif isinstance(result, BaseException):
            raise result
        else:
            response = to_proto(result)
        response.replica_id, response.direct_address = self.replica_id, self.address
        return response, None

    async def stream(self, batches, grpc_context, check, call_from_proto, to_proto,
                     response_type, answer_type, answers_type):
        """The direct stream (ProposeStream, ScoreStream; see specserve.proto): each message's
        calls are queued for the batcher together, and the answers finished meanwhile go back
        in one message, each under its call's tag (deployments.streams)."""
        if not auth.authorized(grpc_context):  # status set, stream ended: Serve's proxy's
            # context has no abort (its AttributeError reached the caller with a traceback)
            unauthenticated(grpc_context, None)
            if not is_direct(grpc_context):  # the proxy applies the status with a message
                yield answers_type()  # only: without one its caller saw a clean end (OK)
            return
        calls = CallStream(self, check, call_from_proto,
                           lambda result: self.respond(result, to_proto, response_type),
                           answer_type)
        async for answers in calls.serve(batches):
            for run in in_messages(answers):  # many calls' q: within the message bound
                yield answers_type(answers=run)

    async def Release(self, request: pb.ReleaseRequest, grpc_context=None) -> pb.ReleaseResponse:
        if not auth.authorized(grpc_context):
            return unauthenticated(grpc_context, pb.ReleaseResponse())
        try:  # an id no call could have: a tombstone of megabytes (deployments.released)
            check_request_id(request.request_id)
        except ValueError as error:
            return refuse(grpc_context, error, pb.ReleaseResponse())
        released = request.request_id in self.engine.sessions
        # its calls still queued were given up, their cancels overtaken: run, a first call
        # made the session again (held until the TTL sweep); a live caller rebuilds (exact).
        # None here, or a request that ended: one may still be on its way (the release
        # overtook it), or several (deployments.released)
        found = self.batcher.withdraw(request.request_id,
                                      StaleBase(f"request {request.request_id!r} was released"))
        if request.ended or not found:
            self.released.add(request.request_id, request.ended)
        self.batcher.forget(request.request_id)
        self.sampling.forget(request.request_id)
        # shielded: a router past its release deadline (the worker busy with a long batch)
        # cancels this handler, and must not cancel the release with it
        await asyncio.shield(self.on_worker(self.release_session, request.request_id))
        return pb.ReleaseResponse(released=released)

    def release_session(self, request_id: str) -> None:
        """On the worker: what the replica holds for a request that ended."""
        self.engine.sessions.release(request_id)


class DrafterPool(PoolReplica, Unserved):
    serves = "the drafter pool"

    async def __init__(self, args: DrafterArgs) -> None:
        torch.set_num_threads(args.torch_threads)
        self.engine = build_drafter(args.spec())
        target = Checkpoint.load(args.target)
        limits = Limits(target.vocab_size, target.max_position_embeddings)
        await self.start(pb_grpc.add_DrafterServicer_to_server, self.engine.propose_batch,
                         args, "drafter", limits)

    def warm_up_calls(self, request_id: str, prompt: tuple[int, ...], params) -> list:
        start = PrefixSync(0, EMPTY_PREFIX_HASH, prompt)
        return [ProposeCall(request_id, start, WARM_UP_K, params, seed=0)]

    def feed_tokens(self, call: ProposeCall) -> int:
        return len(call.sync.new_token_ids) + len(call.assumed_token_ids) + \
            call.num_speculative_tokens * max(1, call.tree_width)

    async def Propose(self, request: pb.ProposeRequest, grpc_context=None) -> pb.ProposeResponse:
        return await self.answer(check_propose, wire.propose_from_proto, request,
                                 wire.block_to_proto, pb.ProposeResponse, grpc_context)

    async def ProposeStream(self, batches, grpc_context):
        async for answers in self.stream(batches, grpc_context, check_propose,
                                         wire.propose_from_proto, wire.block_to_proto,
                                         pb.ProposeResponse, pb.ProposeAnswer,
                                         pb.ProposeAnswers):
            yield answers


class VerifierPool(PoolReplica, Unserved):
    serves = "the verifier pool"

    async def __init__(self, args: VerifierArgs) -> None:
        torch.set_num_threads(args.torch_threads)
        model = load_causal_lm(args.model, args.dtype, args.device)
        self.engine = ModelVerifier(model,
                                    max_cached_requests=args.max_cached_requests,
                                    max_cached_tokens=args.max_cached_tokens,
                                    session_ttl_s=args.session_ttl_s, engine=args.engine,
                                    attention=args.attention,
                                    cuda_graphs=args.cuda_graphs,
                                    kv_cache_tokens=args.kv_cache_tokens,
                                    max_batch_tokens=args.max_batch_tokens,
                                    grammar_tokenizer=grammar_tokenizer_at(
                                        args.model, model.config.vocab_size))
        # one prompt's logprobs at a time: each holds its whole prompt's cache, outside the
        # KV pool's budget (the worker runs one chunk at a time anyway)
        self.prompt_scoring = asyncio.Lock()
        config = self.engine.model.config
        limits = Limits(config.vocab_size, self.engine.max_positions)
        await self.start(pb_grpc.add_VerifierServicer_to_server, self.engine.score_batch,
                         args, "verifier", limits)

    def warm_up_calls(self, request_id: str, prompt: tuple[int, ...], params) -> list:
        """A prefill without a draft, then (greedy: its q is not needed) a K-token verify."""
        start = PrefixSync(0, EMPTY_PREFIX_HASH, prompt)
        calls = [ScoreCall(request_id, start, (), params)]
        if params.greedy:
            step = PrefixSync(len(prompt), prefix_hash(prompt), ())
            calls.append(ScoreCall(request_id, step, prompt[:WARM_UP_K], params))
        return calls

    def release_session(self, request_id: str) -> None:
        self.engine.release_now(request_id)  # its steps' progress too

    def feed_tokens(self, call: ScoreCall) -> int:
        return len(call.sync.new_token_ids) + len(call.draft_token_ids) + 1

    async def Score(self, request: pb.ScoreRequest, grpc_context=None) -> pb.ScoreResponse:
        return await self.answer(check_score, wire.score_from_proto, request,
                                 wire.scores_to_proto, pb.ScoreResponse, grpc_context)

    async def ScoreStream(self, batches, grpc_context):
        async for answers in self.stream(batches, grpc_context, check_score,
                                         wire.score_from_proto, wire.scores_to_proto,
                                         pb.ScoreResponse, pb.ScoreAnswer, pb.ScoreAnswers):
            yield answers

    async def PromptLogprobs(self, request: pb.PromptLogprobsRequest,
                             grpc_context=None) -> pb.PromptLogprobsResponse:
        """A prompt's logprobs (verifier.prompt_scores): each chunk a job of the worker's,
        so that batches run between them, one prompt at a time; no session is made or
        read."""
        if not auth.authorized(grpc_context):
            return unauthenticated(grpc_context, pb.PromptLogprobsResponse())
        try:
            check_prompt_logprobs(request, self.limits)
            scoring = PromptScoring(self.engine.model, list(request.token_ids), request.top_n,
                                    self.engine.max_positions, self.engine.max_batch_tokens)
        except ValueError as error:
            return refuse(grpc_context, error,
                          pb.PromptLogprobsResponse(replica_id=self.replica_id))
        async with self.prompt_scoring:
            started = time.perf_counter()
            while not scoring.done:
                await self.on_worker(scoring.step)
            result = scoring.result()
        response = wire.prompt_logprobs_to_proto(result, request.top_n)
        response.replica_id = self.replica_id
        response.compute_us = int(1e6 * (time.perf_counter() - started))
        return response
