"""The data path's cost per round: Serve's gRPC proxy for every call, the direct path with one
unary call per pool call, and the direct path over one stream per replica (the default).

    python -m bench.serve_overhead [--pair demo] [--max-tokens 64] [--k 4] [--streams 16]

One run on a local Ray: cluster/config.yaml serving the pair three ways in turn (the router's
`direct_data_path` and `direct_streams`), the same prompts, sequential rounds (K drafted then
verified, not pipelined, so each round makes its pool calls one after the other). Prints:
- one request at a time, greedy and sampled: tokens/s, the round split (the pools' own
  compute, transport, router), the overhead p50 (round less the pools' compute) and bytes;
- `--streams` greedy requests at once: tokens/s, the overhead p50 and the mean batches;
- the parts of a call measured alone in this process: a loopback echo as a unary call and
  as a message on an open stream, a thread hop (asyncio to a worker thread and back), and
  encoding plus decoding a K-token call and its answer (greedy, and sampled with the demo
  draft's dense float16 q).
"""

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.pairs import PAIRS, PROMPTS
from bench.records import Tally
from bench.runners import Served, stats_from_http

PATHS = {"proxy": (False, False), "unary": (True, False), "stream": (True, True)}
ECHOES = 2000


async def echo_parts() -> dict[str, float]:
    """ms p50: a unary echo, a stream message's echo (loopback grpc.aio), a thread hop."""
    import grpc

    async def unary(message, context):
        return message

    async def stream(messages, context):
        async for message in messages:
            yield message

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call_unary, call_stream = channel.unary_unary("/echo.Echo/Unary"), \
        channel.stream_stream("/echo.Echo/Stream")()
    worker = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()

    async def on_stream(payload):
        await call_stream.write(payload)
        return await call_stream.read()

    parts = {}
    for name, once in (("echo unary", lambda: call_unary(b"x" * 64)),
                       ("echo stream message", lambda: on_stream(b"x" * 64)),
                       ("thread hop", lambda: loop.run_in_executor(worker, int))):
        times = []
        for i in range(ECHOES + 200):
            started = time.perf_counter()
            await once()
            times.append(time.perf_counter() - started)
        parts[name] = 1000 * statistics.median(times[200:])
    call_stream.cancel()
    await channel.close()
    await server.stop(None)
    return parts


def serialization_ms(k: int, vocab: int) -> dict[str, float]:
    """ms to encode and decode a K-token score call and its answer, both ways, as the router
    and the verifier do (greedy; sampled with a dense float16 q)."""
    from deployments import wire
    from protos import specserve_pb2 as pb
    from speculative.sampling import SamplingParams
    from speculative.types import DraftDists, PrefixSync, ScoreCall, TargetScores

    drafted = tuple(range(1, k + 1))
    q = DraftDists.from_dense(torch.softmax(torch.randn(k, vocab), -1).half())
    cases = {"greedy": (ScoreCall("r", PrefixSync(64, 1, (7,)), drafted,
                                  SamplingParams(temperature=0)),
                        TargetScores(target_token_ids=drafted + (9,))),
             "sampled": (ScoreCall("r", PrefixSync(64, 1, (7,)), drafted,
                                   SamplingParams(temperature=1), q, 5),
                         TargetScores(draft_target_probs=(0.5,) * k,
                                      recovered_token_ids=drafted, bonus_token_id=9))}
    out = {}
    for name, (call, scores) in cases.items():
        def once():
            request = pb.ScoreRequest.FromString(wire.score_to_proto(call).SerializeToString())
            wire.score_from_proto(request, call.sampling)  # the session's
            answer = pb.ScoreResponse.FromString(
                wire.scores_to_proto(scores).SerializeToString())
            wire.scores_from_proto(answer)
        once()
        started = time.perf_counter()
        for _ in range(200):
            once()
        out[f"serialization {name} K={k}"] = 1000 * (time.perf_counter() - started) / 200
    return out


def main() -> None:
    import ray
    from ray import serve

    from deployments.local import app_config
    from engine.models import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="demo")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = PAIRS[args.pair]
    tokenizer = load_tokenizer(pair.target)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    parts = {**asyncio.run(echo_parts()), **serialization_ms(args.k, tokenizer.vocab_size)}
    tallies: dict[tuple, Tally] = {}
    loaded: dict[tuple, dict] = {}
    ray.init(address="local", include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        served = Served()
        for path, (direct, streams) in PATHS.items():
            router = app_config(served.config, "router")["args"]
            router.update(direct_data_path=direct, direct_streams=streams)
            served.use(pair)
            served.complete(prompts[0], 8, 0.0, 0, args.k)  # warm-up
            for temperature in (0.0, 1.0):
                for k in (0, args.k):
                    tally = tallies.setdefault((path, temperature, k), Tally())
                    for index, ids in enumerate(prompts):
                        out, seconds, spec = served.complete(ids, args.max_tokens, temperature,
                                                             index, k)
                        tally.add(len(out), seconds, stats_from_http(spec),
                                  spec["overhead_ms_p50"])
            for k in (0, args.k):
                results, seconds = served.concurrent(prompts[0], args.max_tokens, 0.0, 0, k,
                                                     args.streams)
                specs = [spec for _, _, spec in results]
                loaded[path, k] = {
                    "tokens/s": sum(len(out) for out, _, _ in results) / seconds,
                    "overhead p50": statistics.median(s["overhead_ms_p50"] for s in specs),
                    "verifier batch": statistics.mean(s["mean_batch_size_verifier"] or 0
                                                      for s in specs)}
    finally:
        serve.shutdown()
        ray.shutdown()
    report(pair.name, args, prompts, tallies, loaded, parts)


def report(pair: str, args, prompts, tallies, loaded, parts) -> None:
    print(f"\n{pair} pair, {len(prompts)} prompts x {args.max_tokens} tokens, one request "
          "at a time; ms per round (mean); overhead = round less the pools' compute\n")
    print("| path | T | K | tokens/s | tokens/round | draft | verify | transport | router "
          "| round | overhead p50 | bytes/round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (path, temperature, k), tally in tallies.items():
        stats = tally.stats
        ms = stats.ms_per_round()
        overhead = statistics.median(tally.overhead_p50s)
        print(f"| {path} | {temperature:g} | {k} | {tally.tokens / tally.seconds:.1f} "
              f"| {stats.mean_acceptance_length:.2f} | {ms['draft']:.2f} | {ms['verify']:.2f} "
              f"| {ms['transport']:.2f} | {ms['router']:.2f} | {ms['total']:.2f} "
              f"| {overhead:.2f} | {stats.wire_bytes / stats.rounds:.0f} |")
    print(f"\n{args.streams} greedy requests at once ({args.max_tokens} tokens each)\n")
    print("| path | K | tokens/s | overhead p50 ms | mean verifier batch |")
    print("|---|---|---|---|---|")
    for (path, k), row in loaded.items():
        print(f"| {path} | {k} | {row['tokens/s']:.1f} | {row['overhead p50']:.2f} "
              f"| {row['verifier batch']:.1f} |")
    print("\nthe parts of a call, alone in this process (ms)\n")
    print("| part | ms |")
    print("|---|---|")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
