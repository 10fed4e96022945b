"""The router's own CPU a request path costs, in one process: HTTP requests' choices
(deployments.choices.Choices), whole or streamed, through the router's pool clients
(deployments.clients: wire messages, ReplicaStream's tagged streams, their serialisation)
against fake pool replicas that answer on a timer, batching what each of their cycles
found queued, as a loaded pool does.

    python -m bench.router_path [--streams 16] [--k 0|N|auto] [--stream] [--requests 64]
                                [--max-tokens 96] [--prompt-tokens 37] [--runs 3]
                                [--profile FILE]

Prints the router's CPU microseconds per output token and per round: the process's CPU
less what the fake replicas spend (their decoding, answering and encoding), medians of
`--runs` runs, after the router's start-up objects are frozen (gc.freeze, as the router
does). Greedy requests
of `--max-tokens` tokens, `--streams` at a time; pipelined drafting and plain_steps 4, as
cluster/config.yaml. The pools' answers follow one fixed output, the drafter right but at
every third position (bench.router_turn's InstantPools).
"""

import argparse
import asyncio
import cProfile
import gc
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from bench.newcomer import ROOT
from deployments.admission import Admission
from deployments.choices import Choices
from deployments.pool_handles import GrpcDrafter, GrpcVerifier
from protos import specserve_pb2 as pb
from speculative.driver import text_decoder
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults
from speculative.sampling import SamplingParams


def at(position: int) -> int:
    """The target's token at an output position."""
    return (7 * position) % 500 + 3


class FakeReplica:
    """One pool replica: calls queued by its streams (and the proxy's), answered each cycle
    of `cycle_s`, one message a stream. `spent` sums its own time (its work holds the loop:
    its CPU)."""

    def __init__(self, score: bool, cycle_s: float, prompt_len: int) -> None:
        self.score, self.cycle_s, self.prompt_len = score, cycle_s, prompt_len
        self.queue: list = []  # (stream or future, tag, request message)
        self.wake = asyncio.Event()
        self.spent = 0.0
        self.task = asyncio.ensure_future(self.run())

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(self.cycle_s)
            started = time.perf_counter()
            batch, self.queue = self.queue, []
            answers: dict = {}
            for to, tag, call in batch:
                response = self.answer(call, len(batch))
                if isinstance(to, asyncio.Future):
                    response.direct_address = "fake:1"
                    to.set_result(type(response).FromString(response.SerializeToString()))
                else:
                    answers.setdefault(to, []).append((tag, response))
            for stream, tagged in answers.items():
                stream.deliver(tagged)
            self.spent += time.perf_counter() - started

    def answer(self, call, batch_size: int):
        start = call.sync.known_len + len(call.sync.new_token_ids) - self.prompt_len
        load = pb.BatchLoad(batch_size=batch_size, batch_tokens=batch_size)
        if self.score:
            fed = len(call.draft_token_ids) + 1
            steps = max(1, call.steps)
            return pb.ScoreResponse(
                compute_us=5000, load=load,
                greedy=pb.GreedyScores(target_token_ids=[at(start + i) for i in range(fed)]),
                continued_token_ids=[at(start + fed + i) for i in range(steps - 1)]
                if not call.draft_token_ids else [])
        start += len(call.assumed_token_ids)
        k = call.num_speculative_tokens
        return pb.ProposeResponse(
            token_ids=[at(p) + (p % 3 == 2) for p in range(start, start + k)],
            compute_us=1000 * k, load=load)

    def take(self, to, tag: int, message) -> None:
        self.queue.append((to, tag, message))
        self.wake.set()


class FakeStream:
    """A stream call object as grpc.aio's: write() serialises (the router's work), the
    replica decodes (its own), the answers come back serialised and are decoded on read."""

    def __init__(self, replica: FakeReplica, batch_type, answers_type) -> None:
        self.replica, self.batch_type, self.answers_type = replica, batch_type, answers_type
        self.inbox: asyncio.Queue = asyncio.Queue()

    async def write(self, message) -> None:
        data = message.SerializeToString()
        started = time.perf_counter()
        for entry in self.batch_type.FromString(data).entries:
            self.replica.take(self, entry.tag, entry.call)
        self.replica.spent += time.perf_counter() - started

    def deliver(self, tagged) -> None:
        answers = self.answers_type(answers=[
            pb.ScoreAnswer(tag=t, response=r) if self.replica.score
            else pb.ProposeAnswer(tag=t, response=r) for t, r in tagged])
        self.inbox.put_nowait(answers.SerializeToString())

    def __aiter__(self):
        return self

    async def __anext__(self):
        return self.answers_type.FromString(await self.inbox.get())

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


class FakeStub:
    """The replica's rpcs as a stub's, and the proxy's (the same replica)."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    def _unary(self, message):
        future = asyncio.get_running_loop().create_future()
        self.replica.take(future, 0, type(message).FromString(message.SerializeToString()))
        return future

    async def Score(self, message, **_):  # noqa: N802 (grpc's names)
        return await self._unary(message)

    async def Propose(self, message, **_):  # noqa: N802
        return await self._unary(message)

    async def Release(self, message, **_):  # noqa: N802
        return pb.ReleaseResponse(released=True)

    def ScoreStream(self, **_):  # noqa: N802
        return FakeStream(self.replica, pb.ScoreBatch, pb.ScoreAnswers)

    def ProposeStream(self, **_):  # noqa: N802
        return FakeStream(self.replica, pb.ProposeBatch, pb.ProposeAnswers)


class Counted:
    """The router's metrics, as counts of the choices' tokens and rounds."""

    def __init__(self) -> None:
        self.tokens = self.rounds = 0

    def record_choice(self, state, prompt_tokens, first_text_s, seconds) -> None:
        self.tokens += state.num_output_tokens
        self.rounds += state.stats.rounds


class NoChannel:
    """A channel for the stubs the pool clients build (replaced by FakeStubs)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def pools(cycle_s: float, prompt_len: int
          ) -> tuple[GrpcDrafter, GrpcVerifier, list[FakeReplica]]:
    replicas = [FakeReplica(False, cycle_s, prompt_len), FakeReplica(True, cycle_s, prompt_len)]
    drafter = GrpcDrafter(NoChannel(), "drafter", 30.0, draft_timeout_s=30.0)
    verifier = GrpcVerifier(NoChannel(), "verifier", 30.0)
    for client, replica in zip((drafter, verifier), replicas):
        stub = FakeStub(replica)
        client.pool.proxy = stub
        client.pool._stub = lambda address, stub=stub: stub
    return drafter, verifier, replicas


async def served(streams: int, k: int | str, requests: int, max_tokens: int, stream: bool,
                 cycle_s: float, profile: cProfile.Profile | None = None,
                 prompt_tokens: int = 37, decode=None) -> tuple[float, int, int]:
    """(router CPU seconds, output tokens, rounds) of `requests` requests after a warm-up;
    decode: the demo tokenizer's text_decoder when None."""
    prompt = tuple(3 + i % 500 for i in range(prompt_tokens))
    decode = decode or text_decoder(_tokenizer())
    front = RequestFrontEnd(SpeculationDefaults(num_speculative_tokens=k))
    drafter, verifier, replicas = pools(cycle_s, prompt_tokens)
    admission, render = Admission(streams * 2), ThreadPoolExecutor(4)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    counted = Counted()

    async def one(index: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            plan = front.plan(f"cmpl-{index}", prompt, sampling)
            choices = Choices(plan, (drafter, verifier), decode, counted,
                              admission.admit(1), model="m", chat=False,
                              return_token_ids=False, render=render)
            if stream:
                async for _ in choices.events():
                    pass
            else:
                await choices.complete()
                choices.ticket.release()  # the router's, after a whole answer

    async def batch(count: int, offset: int) -> None:
        gate = asyncio.Semaphore(streams)
        await asyncio.gather(*(one(offset + i, gate) for i in range(count)))

    await batch(streams, 0)  # warm-up
    spent, tokens, rounds = sum(r.spent for r in replicas), counted.tokens, counted.rounds
    if profile is not None:
        profile.enable()
    started = time.process_time()
    await batch(requests, streams)
    cpu = time.process_time() - started
    if profile is not None:
        profile.disable()
    cpu -= sum(r.spent for r in replicas) - spent
    for replica in replicas:
        replica.task.cancel()
    render.shutdown()
    return cpu, counted.tokens - tokens, counted.rounds - rounds


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "models" / "demo" / "target")


def main() -> None:
    os.environ.setdefault("SPECSERVE_POOL_SECRET", "bench")  # no Ray to share one through
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--k", type=lambda text: text if text == "auto" else int(text),
                        default=0, help="a fixed K, or auto (the adaptive K)")
    parser.add_argument("--stream", action="store_true", help="server-sent events")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=37)
    parser.add_argument("--cycle-ms", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", help="write a cProfile of the last run here")
    args = parser.parse_args()
    decode = text_decoder(_tokenizer())
    gc.collect()  # as the router after its start (deployments.router)
    gc.freeze()
    per_token, per_round = [], []
    for run in range(args.runs):
        profile = cProfile.Profile() if args.profile and run == args.runs - 1 else None
        cpu, tokens, rounds = asyncio.run(served(args.streams, args.k, args.requests,
                                                 args.max_tokens, args.stream,
                                                 args.cycle_ms / 1e3, profile,
                                                 args.prompt_tokens, decode))
        per_token.append(cpu / tokens * 1e6)
        per_round.append(cpu / rounds * 1e6)
        if profile is not None:
            profile.dump_stats(args.profile)
    print(f"streams {args.streams} K {args.k} {'streamed' if args.stream else 'whole'}: "
          f"{statistics.median(per_token):.1f} us/token, {statistics.median(per_round):.1f} "
          f"us/round (runs: {', '.join(f'{r:.1f}' for r in per_token)})")


if __name__ == "__main__":
    main()
