"""Where a loaded deployment's CPU goes: each Serve process's CPU per output token.

    python -m bench.router_turn [--streams 16] [--k 0|N|auto] [--seconds 20]
                                [--max-tokens 96] [--in-process [--pipelined]]

A fresh `serve run cluster/config.yaml` (the default deployment, on free ports) serves the
held-out prompts as greedy requests at a fixed K or the default's (`--k auto`; `ignore_eos`),
`--streams` at a time, for `--seconds` after a warm-up. Prints the output tokens/s and, for
each process that used CPU meanwhile (the router, the pools, Serve's proxy and controller,
Ray's own), its share of a core and its CPU microseconds per output token, read from /proc
(Linux).

--in-process: no Serve, no wire. The same number of greedy requests (`--streams` at a time,
each `--max-tokens` long) run through the router's round (`speculative.driver.Generation`,
the demo tokenizer's incremental text) against pools that answer at once, in this process:
the CPU microseconds a token of the round's own code. The pools report the compute times and
the batch (`--streams` calls) that loaded pools would, so that `--k auto` (the adaptive K,
all requests sharing one cost model, as a router's do) runs its loaded path; `--pipelined`
drafts the next block during each verify, as the default config does.

At 16 streams and K = 0 the verifier's batches wait for the router's turn (its rounds'
accepts, commits and next calls, one request after another), so the router's CPU per token
is on the critical path: see docs/benchmarks.md (the data path).
"""

import argparse
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

from bench.newcomer import HELD_OUT, ROOT, fresh_serve_run
from bench.peer import completion
from speculative.driver import Generation, text_decoder
from speculative.state import Request
from speculative.costs import CostModel
from speculative.policy import k_policy
from speculative.sampling import SamplingParams
from speculative.types import BatchLoad, DraftBlock, TargetScores

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (its command line's first 48 characters, user + system CPU seconds)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                name = f.read().split(b"\0")[0].decode(errors="replace")[:48]
        except OSError:  # gone meanwhile
            continue
        found[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / TICKS)
    return found


def loaded(url: str, streams: int, k: int | str, seconds: float, max_tokens: int) -> int:
    """Output tokens of `streams` clients sending requests back to back for `seconds`."""
    fields = {"num_speculative_tokens": k}
    stop = time.monotonic() + seconds

    def client(index: int) -> int:
        tokens = 0
        while time.monotonic() < stop:
            tokens += completion(url, HELD_OUT[index % len(HELD_OUT)], max_tokens, fields)
        return tokens

    with ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(client, range(streams)))


class InstantPools:
    """A drafter and a verifier that answer at once, greedy, from one fixed output: the
    drafter right but at every third position, so rounds commit 1 to K + 1 tokens. Each
    answer reports the compute time and the batch of `batch_size` such calls that loaded
    pools would (the demo pair's float32 costs at about that load)."""

    verify_s, verify_token_s = 5e-3, 4e-4  # a forward, and each token of its batch
    draft_step_s, draft_row_s = 1e-3, 1e-4  # a draft step, and each call in its batch

    def __init__(self, prompt_len: int, batch_size: int = 1) -> None:
        self.prompt_len, self.batch_size = prompt_len, batch_size

    def at(self, position: int) -> int:
        return (7 * position) % 500 + 3

    async def propose(self, call):
        start, k = call.sync.committed_len - self.prompt_len, call.num_speculative_tokens
        return DraftBlock(tuple(self.at(p) + (p % 3 == 2) for p in range(start, start + k)),
                          None, compute_seconds=k * (self.draft_step_s
                                                      + self.draft_row_s * self.batch_size),
                          load=BatchLoad(self.batch_size, k * self.batch_size))

    async def score(self, call):
        start, fed = call.sync.committed_len - self.prompt_len, len(call.draft_token_ids) + 1
        tokens = fed * self.batch_size
        return TargetScores(target_token_ids=tuple(self.at(p) for p in range(start, start + fed)),
                            compute_seconds=self.verify_s + self.verify_token_s * tokens,
                            load=BatchLoad(self.batch_size, tokens))

    async def release(self, request_id: str) -> None:
        pass


def in_process(streams: int, k: int | str, max_tokens: int, requests: int,
               pipelined: bool = False) -> float:
    """CPU microseconds a token of `requests` greedy requests through the round, `streams`
    at a time, against InstantPools (batches of `streams` calls), at K = k (or "auto")."""
    from transformers import AutoTokenizer

    decode = text_decoder(AutoTokenizer.from_pretrained(ROOT / "models" / "demo" / "target"))
    prompt = tuple(range(3, 19))
    pools = InstantPools(len(prompt), streams)
    costs = CostModel()  # a router's, shared by its requests (for "auto")
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens)  # no stop ids

    async def one(index: int, gate: asyncio.Semaphore) -> int:
        async with gate:
            generation = Generation(Request(f"r{index}", prompt, sampling, ()), decode)
            policy = k_policy(k, pipelined, greedy=True, costs=costs)
            await generation.run(pools, pools, policy, pipelined)
            return len(generation.token_ids)

    async def run(count: int) -> int:
        gate = asyncio.Semaphore(streams)
        return sum(await asyncio.gather(*(one(i, gate) for i in range(count))))

    asyncio.run(run(streams))  # warm-up
    started = time.process_time()
    tokens = asyncio.run(run(requests))
    return (time.process_time() - started) / tokens * 1e6


def k_arg(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--k", type=k_arg, default=0, help="a fixed K, or auto")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--in-process", action="store_true",
                        help="the round's own CPU against pools that answer at once")
    parser.add_argument("--pipelined", action="store_true",
                        help="in process: draft the next block during each verify")
    args = parser.parse_args()
    if args.in_process:
        us = in_process(args.streams, args.k, args.max_tokens, 10 * args.streams,
                        args.pipelined)
        print(f"in process, {args.streams} streams, K = {args.k}"
              f"{', pipelined' if args.pipelined else ''}: {us:.1f} us of CPU a token")
        return
    with fresh_serve_run() as (port, _):
        url = f"http://127.0.0.1:{port}"
        loaded(url, args.streams, args.k, 3.0, 8)  # warm-up
        before, started = cpu_seconds(), time.perf_counter()
        tokens = loaded(url, args.streams, args.k, args.seconds, args.max_tokens)
        wall, after = time.perf_counter() - started, cpu_seconds()
    print(f"{args.streams} streams, K = {args.k}: {tokens / wall:.0f} tokens/s "
          f"over {wall:.1f} s")
    used = sorted(((after[pid][1] - before[pid][1], name) for pid, (name, _) in after.items()
                   if pid in before), reverse=True)
    for seconds, name in used:
        if seconds / wall >= 0.01:
            print(f"  {seconds / wall:6.1%} of a core  {seconds / tokens * 1e6:6.0f} us/token"
                  f"  {name}")


if __name__ == "__main__":
    main()
