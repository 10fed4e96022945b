"""A prompt's prefill in a batch of decodes: one layout against two (engine.attention).

    python -m bench.mixed_batches [--context 60 500] [--prompts 16 30 100 200] [--repeats 7]

The demo target as its verifier pool runs it (one thread, the default attention backend):
one verify batch of D decoding requests (each a bonus token and K drafted tokens over a
context of C cached positions) beside a new request's P-token prompt, laid out as the
forward chooses (`feed_groups`: two groups where that halves the attention work) and forced
into one layout, every row padded to the prompt's length. Medians over repeats, the two
alternated; the ratio is from the same run.
"""

import argparse
import statistics
import time

import torch

import engine.lean
from engine.attention import feed_groups
from engine.models import DEMO_TARGET, load_causal_lm
from specserve.gpu_measures import prompts
from speculative.prefixes import EMPTY_PREFIX_HASH, prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ScoreCall
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0.0)
LAYOUTS = {"one": lambda segments: None, "groups": feed_groups}


class Batches:
    """Decoding requests kept in a verifier, and fresh prompts beside them."""

    def __init__(self, verifier: ModelVerifier, decodes: int, context: int) -> None:
        self.verifier, self.prompts = verifier, 0
        self.vocab = verifier.model.config.vocab_size
        self.committed = {f"d{j}": prompts(1, context, self.vocab, seed=j)[0]
                          for j in range(decodes)}
        for request_id, ids in self.committed.items():
            verifier.score_now(ScoreCall(request_id, PrefixSync(0, EMPTY_PREFIX_HASH,
                                                                tuple(ids)), (), GREEDY))

    def run(self, k: int, prompt: int) -> float:
        """Seconds of one batch: every decode's next round and a new prompt."""
        calls = []
        for request_id, ids in self.committed.items():
            sync = PrefixSync(len(ids), prefix_hash(ids), (5,))
            calls.append(ScoreCall(request_id, sync, tuple(range(11, 11 + k)), GREEDY))
            ids.append(5)
        self.prompts += 1
        new = f"p{self.prompts}"
        fed = tuple(prompts(1, prompt, self.vocab, seed=100 + self.prompts)[0])
        calls.append(ScoreCall(new, PrefixSync(0, EMPTY_PREFIX_HASH, fed), (), GREEDY))
        started = time.perf_counter()
        self.verifier.score_batch(calls)
        elapsed = time.perf_counter() - started
        self.verifier.sessions.release(new)
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--k", type=int, default=4, help="drafted tokens per decode")
    parser.add_argument("--context", type=int, nargs="+", default=[60, 500])
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 30, 100, 200])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_causal_lm(DEMO_TARGET)
    print(f"{args.decodes} decodes of {args.k + 1} tokens beside a prompt, the demo target, "
          f"one thread; ms per batch (median of {args.repeats})")
    print("| context | prompt | one layout | two groups | one / two |")
    print("|---|---|---|---|---|")
    for context in args.context:
        batches = Batches(ModelVerifier(model), args.decodes, context)
        for prompt in args.prompts:
            times = {name: [] for name in LAYOUTS}
            for _ in range(args.repeats + 1):  # the first of each is a warm-up
                for name, layout in LAYOUTS.items():
                    engine.lean.feed_groups = layout
                    times[name].append(batches.run(args.k, prompt) * 1e3)
            one, two = (statistics.median(times[name][1:]) for name in LAYOUTS)
            print(f"| {context} | {prompt} | {one:.1f} | {two:.1f} | {one / two:.2f}x |")
    engine.lean.feed_groups = feed_groups


if __name__ == "__main__":
    main()
