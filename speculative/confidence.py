"""Draft length by confidence, with the cut learnt from acceptance (EAGLE-2's dynamic draft
length, whose threshold is a constant there).

A model drafter may end a block once its confidence c (the drafted tokens' probabilities
multiplied, under the draft's own law) falls below a threshold τ (drafter.model). Whether
one more token pays depends on the pair and the machine. Drafting token j + 1 after a
confidence c_j:
- costs Δt, a draft step and one more verified token (CostModel.token_seconds);
- makes one more token exactly when tokens 1..j+1 are all accepted.
So it pays while P(1..j+1 accepted | c_j) >= r Δt, where r is the request's tokens per
second: the tokens its rounds make in Δt.

`ConfidenceCut` learns P(1..j+1 accepted | c_j) by bucket of c_j from the blocks the drafter
reports. Each bucket starts at an optimistic prior (every token pays, so nothing is cut
before it is measured), and τ is the edge where cutting every token below it gains the most
(the buckets' gains summed, so that one noisy bucket cannot cut the paying ones below it).
A distilled draft's argmax is often right where its own probability is low: a fixed τ cut
blocks that were paying (docs/benchmarks.md, draft length by confidence). The buckets
measure that instead of assuming it.

The rule reads only the draft's side, so any τ is as exact as any K.
"""

from bisect import bisect_right

# the buckets' lower edges: finer where confidences of a few tokens fall
EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)


class ConfidenceCut:
    """P(the next drafted token is accepted, with those before it | the confidence before
    it), by bucket; and the threshold that keeps the tokens that pay."""

    prior_weight = 2.0  # positions of the optimistic prior (P = 1) in each bucket
    decay = 0.98  # per block observed, every bucket: old regimes fade, and each bucket's
    # weight follows how often its confidences occur now
    margin = 0.05  # of a token per token cut: what a cut must gain beyond breaking even

    def __init__(self) -> None:
        self.accepted = [self.prior_weight] * len(EDGES)
        self.seen = [self.prior_weight] * len(EDGES)

    def observe(self, confidences, num_accepted: int) -> None:
        """A chain's block: its confidence after each drafted token, and how many of its
        tokens the round accepted. Token j + 1 was drafted after confidence c_j."""
        self.accepted = [self.decay * count for count in self.accepted]
        self.seen = [self.decay * count for count in self.seen]
        for j, confidence in enumerate(confidences[:-1], start=1):
            bucket = bucket_of(confidence)
            self.accepted[bucket] += num_accepted > j
            self.seen[bucket] += 1.0

    def threshold(self, tokens_per_second: float, token_seconds: float) -> float:
        """τ: the edge below which cutting gains the most, by the measured buckets. Cutting
        a token saves its time, worth `bar` = r Δt tokens, and loses P(accepted) tokens;
        the gain of a cut at an edge is that difference summed over the tokens below it
        (each bucket weighted by how often it is seen), less `margin` of them: a noisy
        bucket alone moves nothing, and a cut that gains nothing clearly is no cut."""
        bar = tokens_per_second * token_seconds
        best, best_gain, gain = 0.0, 0.0, 0.0
        for bucket, edge in enumerate(EDGES[1:]):  # a cut at `edge` drops buckets below it
            seen = self.seen[bucket]
            gain += seen * (bar - self.margin) - self.accepted[bucket]
            if gain > best_gain:
                best, best_gain = edge, gain
        return best


def bucket_of(confidence: float) -> int:
    return max(0, bisect_right(EDGES, confidence) - 1)
