"""How many tokens to draft next round (the K policy).

FixedK drafts the same K every round. AdaptiveK chooses, before each round, the K that the
request's acceptance so far and the measured costs say gives the most tokens per second:

    tokens(K) = (1 - α^(K+1)) / (1 - α)                  expected output of a round
    time(K)   = t(K+1) + K d + h                           draft, then verify (sequential)
    time(K)   = max(t(K+1), K' d) + (1 - P) K d + h        pipelined: the next block is
                                                            drafted during this verify

t(n) is the verifier's time for an n-token forward, d the drafter's time per token, h what a
round spends beyond both (hops, the router's work), P = α^K the chance that the pre-drafted
block is used (the whole block accepted) and K' the pre-draft's length. A sampled pipelined
round loses its bonus token when the pre-draft is used (loop.continue_with_predraft), so its
tokens(K) is α^K smaller. With the drafter off the critical path the best K is near where
K d ≈ t(K+1), further out than where the sequential formula peaks.
"""

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RoundCost:
    """What one round cost: its verify and draft compute and the rest of its time."""

    verify_tokens: int  # K + 1 positions scored
    verify_seconds: float
    draft_tokens: int  # tokens the drafter computed for this round (0 if pre-drafted)
    draft_seconds: float
    overhead_seconds: float  # the round's time beyond the pools' compute
    # the verifier's batch that scored the round: calls in it and tokens it fed (0: unknown,
    # e.g. a verifier that reports no load; the round's own verify_tokens stand for them)
    batch_size: int = 1
    batch_tokens: int = 0
    draft_hop_seconds: float = 0.0  # waiting for this round's draft beyond its compute


class KPolicy(Protocol):
    def num_speculative_tokens(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int, cost: RoundCost | None = None) -> None: ...


class FixedK:
    """The same K every round (vLLM's num_speculative_tokens)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.k = num_speculative_tokens

    def num_speculative_tokens(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int, cost: RoundCost | None = None) -> None:
        pass


class Ema:
    """An exponential moving average that is None until its first value."""

    def __init__(self, weight: float) -> None:
        self.weight, self.value = weight, None

    def add(self, value: float) -> None:
        self.value = value if self.value is None else \
            (1 - self.weight) * self.value + self.weight * value


class CostModel:
    """The pools' costs as the rounds measure them, shared by a router's requests.

    The verifier's forward time is a line a + b (N - 1) in the tokens N its batch feeds,
    fitted to the mean time of each N seen (a new machine's curve is learnt, not configured);
    until two different N are seen the slope is `prior_slope` of t(1) per extra token.

    Load: the verifier batches the rounds of all requests that call it meanwhile, B of them
    on average (measured from its answers). If each drafts K, a round's forward feeds about
    B (K + 1) tokens, so t(K + 1) is read off the line at N = B (K + 1). Drafted tokens cost
    everyone in the batch: as B grows, a K's extra tokens grow B-fold in the forward while a
    request's tokens per round do not, so the best K shrinks, down to 0 (speculation off)
    once the forward's fixed cost a is small beside B b, and comes back as B falls.
    """

    def __init__(self, prior_slope: float = 0.1, weight: float = 0.05) -> None:
        self.prior_slope, self.weight = prior_slope, weight
        self.verify: dict[int, Ema] = {}
        self.draft_per_token, self.overhead = Ema(weight), Ema(weight)
        # a round without a draft (K = 0) makes one pool call, not two: its own overhead,
        # estimated until such rounds are seen as the overhead less the draft call's hop
        self.overhead_plain, self.draft_hop = Ema(weight), Ema(weight)
        self.alpha = Ema(weight)  # acceptance across requests: a new request's prior
        self.batch = Ema(weight)  # calls per verifier batch
        self.line = (1.0, prior_slope)  # t(1) and seconds per extra token (t(1) units a priori)

    def observe(self, cost: RoundCost) -> None:
        if cost.verify_tokens > 0 and cost.verify_seconds > 0:
            tokens = cost.batch_tokens or cost.verify_tokens
            self.verify.setdefault(tokens, Ema(self.weight)).add(cost.verify_seconds)
            self.line = self.fit()
            self.batch.add(max(1, cost.batch_size))
        if cost.draft_tokens > 0 and cost.draft_seconds > 0:
            self.draft_per_token.add(cost.draft_seconds / cost.draft_tokens)
        if cost.verify_tokens <= 1:
            self.overhead_plain.add(max(0.0, cost.overhead_seconds))
        else:
            self.overhead.add(max(0.0, cost.overhead_seconds))
        if cost.draft_hop_seconds > 0:
            self.draft_hop.add(cost.draft_hop_seconds)

    def fit(self) -> tuple[float, float]:
        """(t(1), slope) of the line through the mean verify time of each n seen."""
        points = [(n, ema.value) for n, ema in self.verify.items()]
        if len(points) == 1:
            n, seconds = points[0]
            base = seconds / (1 + self.prior_slope * (n - 1))
            return base, self.prior_slope * base
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / \
            sum((n - mean_n) ** 2 for n, _ in points)
        slope = max(0.0, slope)  # noise must not make longer verifies look cheaper
        return mean_t + slope * (1 - mean_n), slope

    def verify_seconds(self, num_tokens: int) -> float:
        """A round's verify time when it scores num_tokens (K + 1), in a batch of B such."""
        return self.forward_seconds(self.batch_size() * num_tokens)

    def forward_seconds(self, batch_tokens: float) -> float:
        base, slope = self.line
        return max(1e-6, base + slope * (batch_tokens - 1))

    def batch_size(self) -> float:
        return self.batch.value or 1.0

    def draft_seconds_per_token(self) -> float:
        value = self.draft_per_token.value
        return 0.1 * self.forward_seconds(1) if value is None else value

    def overhead_seconds(self, k: int = 1) -> float:
        """A round's time beyond the pools' compute, with a draft call (k > 0) or without."""
        drafting = self.overhead.value or 0.0
        if k > 0:
            return drafting
        if self.overhead_plain.value is not None:
            return self.overhead_plain.value
        return max(0.0, drafting - (self.draft_hop.value or 0.0))


def expected_tokens(alpha: float, k: int) -> float:
    """E[N] = (1 - α^(K+1)) / (1 - α): a round's output for i.i.d. acceptance α."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class KBounds:
    min: int = 1
    max: int = 8
    initial: int | None = None  # the first round's K (None: the best under the prior)

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.max:
            raise ValueError(f"K bounds need 0 <= min <= max, got {self.min} and {self.max}")


class AdaptiveK:
    """Per request: the K in [min, max] that maximises expected tokens per second.

    α is the request's own acceptance, counted per position tested (a round that accepts n of
    K tested n + 1 positions, or K when all were accepted), with older rounds decaying and the
    router-wide acceptance as a prior worth `prior_weight` positions.
    """

    def __init__(self, bounds: KBounds, costs: CostModel, pipelined: bool, greedy: bool,
                 prior_alpha: float = 0.6, prior_weight: float = 4.0,
                 decay: float = 0.85) -> None:
        self.bounds, self.costs = bounds, costs
        self.pipelined, self.greedy = pipelined, greedy
        prior = costs.alpha.value if costs.alpha.value is not None else prior_alpha
        self.accepted, self.tested = prior * prior_weight, prior_weight
        self.decay = decay
        self.rounds_at_zero = 0
        # the first round: what the prior and the costs measured so far say, unless configured
        self.k = self.choose() if bounds.initial is None else \
            min(max(bounds.initial, bounds.min), bounds.max)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tested

    def num_speculative_tokens(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int, cost: RoundCost | None = None) -> None:
        if num_drafted:
            tested = num_accepted + (num_accepted < num_drafted)
            self.accepted = self.decay * self.accepted + num_accepted
            self.tested = self.decay * self.tested + tested
            self.costs.alpha.add(num_accepted / tested)
        if cost is not None:
            self.costs.observe(cost)
        self.k = self.choose()
        # K = 0 learns nothing of α: try one token every 8 rounds
        self.rounds_at_zero = self.rounds_at_zero + 1 if self.k == 0 else 0
        if self.rounds_at_zero >= 8:
            self.k, self.rounds_at_zero = 1, 0

    def choose(self) -> int:
        return max(range(self.bounds.min, self.bounds.max + 1), key=self.rate)

    def rate(self, k: int) -> float:
        """Expected tokens per second at K = k."""
        costs, alpha = self.costs, self.alpha
        verify = costs.verify_seconds(k + 1)
        per_token = costs.draft_seconds_per_token()
        tokens = expected_tokens(alpha, k)
        if k == 0:
            seconds = verify
        elif not self.pipelined:
            seconds = verify + k * per_token
        else:
            used = alpha ** (k + self.greedy)  # the block accepted (greedy: and y1 == bonus)
            predraft = (k + self.greedy) * per_token
            seconds = max(verify, predraft) + (1 - used) * k * per_token
            if not self.greedy:
                tokens -= alpha ** k
        return tokens / (seconds + costs.overhead_seconds(k))


def k_policy(k: int | str, pipelined: bool, greedy: bool, bounds: KBounds | None = None,
             costs: CostModel | None = None) -> KPolicy:
    """FixedK(k), or for k == "auto" an AdaptiveK in `bounds` learning into `costs`."""
    if k != "auto":
        return FixedK(k)
    return AdaptiveK(bounds or KBounds(), costs or CostModel(), pipelined, greedy)
