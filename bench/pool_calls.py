"""The pools' own work around their forwards: each pool's time a batch outside the model.

    python -m bench.pool_calls [--requests 16] [--k 4] [--batches 200] [--prompt-tokens 200]

The demo target and draft, one thread, in this process (no Serve, no wire): `--requests`
requests of `--prompt-tokens` tokens, prefilled, then batches of one call per request, round
after round, as the router sends them. Each round commits the block's first two tokens and
one of the target's own, so the pools roll their caches back as they do served. Three
workloads: greedy K = 0 (the verifier alone), greedy K and sampled K (T = 1, both pools).
Prints, per pool, the median time a batch spends in the model's forwards (timed around its
runner's forward) and outside them: checking and syncing the calls, their caches, the
draws, the answers. At 16 streams every microsecond of it is on the served round's
critical path (docs/benchmarks.md, the data path).
"""

import argparse
import statistics
import time

import torch

from speculative.prefixes import GrowingPrefixHash
from speculative.state import PoolView
from speculative.sampling import SamplingParams
from speculative.types import NO_DRAFT, PrefixSync, ProposeCall, ScoreCall


class ForwardClock:
    """Wraps a runner's forward (on the instance) and adds up the seconds spent in it."""

    def __init__(self, runner) -> None:
        self.seconds, self.calls, self.forward = 0.0, 0, runner.forward
        runner.forward = self

    def __call__(self, segments):
        started = time.perf_counter()
        try:
            return self.forward(segments)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


def batch_time(work, clock: ForwardClock, *args) -> tuple:
    """(work's result, seconds in forwards, seconds outside them)."""
    before, started = clock.seconds, time.perf_counter()
    result = work(*args)
    forwards = clock.seconds - before
    return result, forwards, time.perf_counter() - started - forwards


class Requests:
    """The requests' committed tokens and what each pool was last told of them (the router's
    PoolView per pool)."""

    def __init__(self, count: int, prompt_tokens: int, vocab_size: int) -> None:
        self.committed = [[(7 * i + j) % (vocab_size - 1) + 1 for j in range(prompt_tokens)]
                          for i in range(count)]
        self.hashers = [GrowingPrefixHash() for _ in range(count)]
        self.views = {pool: [PoolView() for _ in range(count)] for pool in ("drafter", "verifier")}

    def sync(self, pool: str, index: int) -> PrefixSync:
        return self.views[pool][index].prefix_sync(self.committed[index])

    def commit(self, index: int, drafted: tuple, own: int) -> None:
        """Both pools hold the prefix they were just sent; then the round's tokens."""
        ids = self.committed[index]
        fingerprint = self.hashers[index].of(ids)
        for views in self.views.values():
            views[index].confirm(len(ids), fingerprint)
        ids.extend([*drafted[:2], own])


def own_token(scores, position: int) -> int:
    """The target's token at `position` of a block (greedy: its argmax; sampled: the
    residual draw, or the bonus draw after the block)."""
    if scores.target_token_ids:
        return scores.target_token_ids[position]
    drawn = scores.recovered_token_ids
    return drawn[position] if position < len(drawn) else scores.bonus_token_id


def measure(drafter, verifier, requests: int, k: int, batches: int, prompt_tokens: int,
            temperature: float) -> dict:
    """{pool: (median seconds a batch in forwards, median outside them)}, after a prefill
    batch and a few warm-up rounds; k = 0: the verifier alone."""
    params = SamplingParams(temperature=temperature)
    state = Requests(requests, prompt_tokens, verifier.model.config.vocab_size)
    clocks = {"drafter": ForwardClock(drafter.runner), "verifier": ForwardClock(verifier.runner)}
    times: dict[str, list] = {"drafter": [], "verifier": []}
    for round_ in range(batches + 4):
        seed = 1000 * round_
        blocks = [NO_DRAFT] * requests
        if k:
            calls = [ProposeCall(f"r{i}", state.sync("drafter", i), k, params, seed=seed + i)
                     for i in range(requests)]
            blocks, *drafter_times = batch_time(drafter.propose_batch, clocks["drafter"], calls)
        calls = [ScoreCall(f"r{i}", state.sync("verifier", i), blocks[i].token_ids, params,
                           blocks[i].draft_probs, seed=seed + i) for i in range(requests)]
        scores, *verifier_times = batch_time(verifier.score_batch, clocks["verifier"], calls)
        for i, answer in enumerate(scores):
            drafted = blocks[i].token_ids
            state.commit(i, drafted, own_token(answer, min(2, len(drafted))))
        if round_ >= 4:  # the first: prefills; then warm-up
            times["verifier"].append(verifier_times)
            if k:
                times["drafter"].append(drafter_times)
    return {pool: tuple(statistics.median(column) for column in zip(*rows))
            for pool, rows in times.items() if rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    args = parser.parse_args()
    from drafter.model import ModelDrafter
    from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
    from verifier.engine import ModelVerifier

    torch.set_num_threads(1)  # as a pool replica runs
    target = load_causal_lm(DEMO_TARGET, "float32", "cpu")
    draft = load_causal_lm(DEMO_DRAFT, "float32", "cpu")
    print(f"{args.requests} requests of {args.prompt_tokens} prompt tokens, "
          f"medians of {args.batches} batches")
    for name, k, temperature in (("greedy K = 0", 0, 0.0), (f"greedy K = {args.k}", args.k, 0.0),
                                 (f"sampled K = {args.k}", args.k, 1.0)):
        drafter = ModelDrafter(draft, vocab_size=target.config.vocab_size)
        verifier = ModelVerifier(target)
        result = measure(drafter, verifier, args.requests, k, args.batches,
                         args.prompt_tokens, temperature)
        for pool, (forwards, outside) in result.items():
            print(f"{name:>14}  {pool:>8}: forwards {forwards * 1e3:6.2f} ms, "
                  f"outside them {outside * 1e3:5.2f} ms a batch")


if __name__ == "__main__":
    main()
