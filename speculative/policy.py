"""How many tokens to draft next round (the K policy).

FixedK drafts the same K every round. AdaptiveK chooses, before each round, the K that the
request's acceptance so far and the measured costs say gives the most tokens per second:

    tokens(K) = (1 - α^(K+1)) / (1 - α)                  expected output of a round
    time(K)   = t(B (K+1)) + d(K) + h                      draft, then verify (sequential)
    time(K)   = max(t(B (K+1)), d(K+1)) + h               pipelined: the next block is
                                                            drafted during this verify

t(n) is the verifier's forward time when its batch feeds n tokens (B rounds of K + 1),
d(n) = d0 + n d1 the drafter's time for an n-token call, h what a round spends beyond both
(hops, the router's work). A pipelined round after a rejection verifies no draft beside a
fresh draft of K + 1 (AdaptiveK.pipelined_rate weighs the two kinds of round).

"Beside" is measured, not assumed: a pipelined round takes max(t, d) + λ min(t, d) + h0,
where λ is the share of the shorter part that did not overlap, as the pipelined rounds at
about this load measure it (CostModel.overlap), and h0 a round's time beyond compute
without a draft. On separate machines λ is near 0 (measured at one stream here: 0.02);
where the pools share cores they take turns and λ nears 1.
Costs stay those of a batch in which every request runs the K being weighed (t at B (K + 1)
tokens): under load a request's own round lasts as long as the batch cycle whatever its K,
so its own round times would make every K look free to it while its drafts slow everyone.
Under batch load every request runs the router's one K (AdaptiveK.batch_k): measured at 16
streams, requests that each chose their own K (mostly 1 to 3) made 0.6x the tokens of all
at K = 2, as a drafter batch lasts as long as its longest block. That K is then tried, not
modelled: phases of the whole batch at another K, each judged against the phases around it
(BatchTrials), decide it once they have judged one.

What keeps the estimates honest (a policy that believes speculation is dear stops drafting,
and a K it never runs is a K it never measures):
- costs come from warm, comparable rounds only: a request's first round (prefills) and rounds
  that rebuilt a cache are not costs; a draft that first caught up on many tokens committed
  while the request ran without drafts is not a draft cost;
- each cost is the median of its recent values, so one cold or stray value moves nothing;
- the verify line is fitted to every token count seen, weighted by how often it was seen,
  through the measured t(1) when there is one;
- every `explore_every` rounds a request runs a neighbour of its K (one up, then one down),
  so the costs of the K it might choose next are measured, not assumed;
- K = 0 (speculation off) is reachable only when it pays under batch load (or when this
  request's draft is measured to be useless), with a margin to enter and to leave, and it is
  left as soon as the load falls.
"""

import math
from collections import deque
from dataclasses import dataclass
from statistics import median_low
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
    # False for rounds whose costs say nothing about a K: a request's first round (prompt
    # prefills), a round that rebuilt a pool's cache
    comparable: bool = True
    # committed tokens the drafter fed before drafting (catching up after rounds without a
    # draft): beyond a round's usual one or two, its draft time is not a draft cost
    draft_catch_up: int = 0
    # how the round ran (ROUND_KINDS; "": none of them) and its wall time, start to commit
    kind: str = ""
    wall_seconds: float = 0.0
    tokens: int = 0  # committed by the round


# plain: no draft; sequential: draft, then verify; carried: verify of a pre-drafted block
# beside a pre-draft of K + 1; fresh: verify of no draft beside a fresh draft of K + 1
ROUND_KINDS = ("plain", "sequential", "carried", "fresh")
BESIDE = ("carried", "fresh")


def load_bucket(batch_size: float) -> int:
    """Verifier batches of about the same size (powers of two) share their overlap."""
    return max(0, round(math.log2(max(1.0, batch_size))))


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


class Recent:
    """The lower median of the last `size` values (None before the first): robust to a cold
    start or a stray value (of two values, the lower: slow is what cold and stray values
    are), and it forgets old regimes after `size` new values."""

    def __init__(self, size: int = 31) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.median: float | None = None  # of the values as they are (None: not yet taken)

    def add(self, value: float) -> None:
        self.values.append(value)
        self.median = None

    @property
    def value(self) -> float | None:
        if self.median is None and self.values:
            self.median = median_low(self.values)
        return self.median


class Curve:
    """Times by size (tokens): a median per size and how often each size was seen lately,
    fitted with a weighted line a + b (n - 1); b >= 0 (noise must not make more tokens look
    cheaper)."""

    def __init__(self, decay: float = 0.02) -> None:
        self.points: dict[int, Recent] = {}
        self.seen: dict[int, float] = {}  # decayed counts: how common each size is now
        self.decay = decay
        self.fitted: dict[float, tuple[float, float]] = {}  # by prior slope, until an add

    def add(self, size: int, seconds: float) -> None:
        for n in self.seen:
            self.seen[n] *= 1 - self.decay
        self.points.setdefault(size, Recent()).add(seconds)
        self.seen[size] = self.seen.get(size, 0.0) + 1.0
        self.fitted.clear()

    def __bool__(self) -> bool:
        return bool(self.points)

    def confirmed(self) -> list[int]:
        """The sizes seen at least twice (a size seen once may have been seen cold), or
        every size while none has been."""
        twice = [n for n, recent in self.points.items() if len(recent.values) > 1]
        return twice or list(self.points)

    def fit(self, prior_slope: float) -> tuple[float, float]:
        """(a, b): the line through an anchor, the measured value at n = 1 when there is one,
        else at the most common size, whose slope is the mean of the slopes from the anchor
        to every other size, weighted by how often each is seen (a rare size, however far
        out, weighs as rarely as it occurs); one size alone gets `prior_slope` of a."""
        sizes = self.confirmed()
        anchor = 1 if 1 in sizes else max(sizes, key=self.seen.get)
        base = self.points[anchor].value
        others = [(n, self.points[n].value, self.seen[n]) for n in sizes if n != anchor]
        if others:
            slope = sum(w * (t - base) / (n - anchor) for n, t, w in others) / \
                sum(w for _, _, w in others)
            slope = max(0.0, slope)
        else:
            slope = prior_slope * base / (1 + prior_slope * (anchor - 1))
        return max(1e-6, base - slope * (anchor - 1)), slope


# a drafter fed more committed tokens than a round's usual (its last draft token and the
# bonus) was catching up after rounds without a draft
USUAL_CATCH_UP = 2


class BatchTrials:
    """Under batch load every request runs the router's one K (`k`), in phases of rounds;
    some phases try another K for the whole batch. A tried K is judged by its phase's yield
    (tokens committed over the rounds' wall seconds) against the phases just before and just
    after it, at the K in force: the load drifts as requests start and end, and a phase's
    yield moves with it (measured at 16 streams: 30 % within a run, more than the
    differences between K = 0, 1 and 2), which an average over time would take for the K."""

    def __init__(self, keep: int = 4) -> None:
        self.k: int | None = None  # the K in force (None: not chosen yet)
        self.rounds = 0  # rounds run under batch load, which number the phases
        self.judged = False  # whether a trial has been judged (then trials move K, not a model)
        self.open: dict[int, list] = {}  # phase -> [K, tokens, seconds] while it runs
        self.newest = -1
        self.closed: deque[tuple[int, int, float]] = deque(maxlen=3)  # (phase, K, yield)
        # per tried K, its phases' yields over their neighbours', since the K last changed
        self.ratios: dict[int, deque[float]] = {}
        self.keep = keep

    def record(self, phase: int, k: int, tokens: int, seconds: float) -> None:
        """A round run at K = k, assigned in `phase`. A phase closes once rounds of two
        later phases come in (each request's round of it has ended by then)."""
        if phase < self.newest - 1 or seconds <= 0:
            return  # a straggler of a closed phase
        entry = self.open.setdefault(phase, [k, 0, 0.0])
        entry[1], entry[2] = entry[1] + tokens, entry[2] + seconds
        self.newest = max(self.newest, phase)
        for done in sorted(p for p in self.open if p <= self.newest - 2):
            k_done, tokens_done, seconds_done = self.open.pop(done)
            self.close(done, k_done, tokens_done / seconds_done)

    def close(self, phase: int, k: int, rate: float) -> None:
        self.closed.append((phase, k, rate))
        if len(self.closed) < 3:
            return
        (p0, k0, y0), (p1, k1, y1), (p2, k2, y2) = self.closed
        if p2 - p1 == p1 - p0 == 1 and k0 == k2 == self.k != k1 and y0 + y2 > 0:
            self.ratios.setdefault(k1, deque(maxlen=self.keep)).append(2 * y1 / (y0 + y2))
            self.judged = True

    def better(self, margin: float, least: int = 2) -> int | None:
        """The tried K whose phases beat their neighbours by more than `margin` (geometric
        mean of its last trials, at least `least` of them), the best such; else None."""
        best, best_gain = None, 1.0 + margin
        for k, ratios in self.ratios.items():
            if len(ratios) < least:
                continue
            gain = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def switch(self, k: int) -> None:
        """Put K = k in force; what was tried was relative to the old K."""
        self.k = k
        self.ratios.clear()


class CostModel:
    """The pools' costs as warm rounds measure them, shared by a router's requests.

    Verify: the forward's time as a line in the tokens its batch feeds (a new machine's curve
    is learnt, not configured); until two sizes are seen the slope is `prior_slope` of t(1)
    per extra token. Draft: a call's time as a per-call part plus a per-token part.
    Overheads: a round's time beyond the pools' compute, with a draft call and without.
    """

    def __init__(self, prior_slope: float = 0.1) -> None:
        self.prior_slope = prior_slope
        self.verify, self.draft = Curve(), Curve()
        # a round's time beyond compute, with a draft call and without, by load bucket (under
        # load it holds the waits of the batch cycle)
        self.overhead: dict[int, Recent] = {}
        self.overhead_plain: dict[int, Recent] = {}
        self.draft_hop = Recent()
        self.alpha = Ema(0.05)  # acceptance across requests: a new request's prior
        self.trials = BatchTrials()  # the K of every request under batch load, tried
        # λ: the share of a pipelined round's shorter part (verify or draft) that did not
        # overlap the other, by load bucket
        self.overlap: dict[int, Recent] = {}

    def observe(self, cost: RoundCost) -> None:
        if not cost.comparable:
            return
        if cost.verify_tokens > 0 and cost.verify_seconds > 0:
            self.verify.add(cost.batch_tokens or cost.verify_tokens, cost.verify_seconds)
        if cost.draft_tokens > 0 and cost.draft_seconds > 0 \
                and cost.draft_catch_up <= USUAL_CATCH_UP:
            self.draft.add(cost.draft_tokens, cost.draft_seconds)
        bucket = load_bucket(cost.batch_size)
        (self.overhead_plain if cost.verify_tokens <= 1 else self.overhead).setdefault(
            bucket, Recent()).add(max(0.0, cost.overhead_seconds))
        if cost.draft_hop_seconds > 0:
            self.draft_hop.add(cost.draft_hop_seconds)
        shorter = min(cost.verify_seconds, cost.draft_seconds)
        if cost.kind in BESIDE and cost.wall_seconds > 0 and shorter > 0:
            exposed = cost.wall_seconds - self.overhead_seconds(0, cost.batch_size) - \
                max(cost.verify_seconds, cost.draft_seconds)
            self.overlap.setdefault(bucket, Recent()).add(
                min(1.0, max(0.0, exposed / shorter)))

    def exposed_share(self, load: float) -> float | None:
        """λ at this load (the nearest load measured; None before any pipelined round)."""
        return nearest(self.overlap, load, least=2)

    def round_seconds(self, kind: str, k: int, load: float) -> float:
        """A round of this kind at K = k when the verifier's batches hold `load` calls, each
        at this K (ROUND_KINDS; the module's formulas)."""
        if kind == "plain":
            return self.forward_seconds(load) + self.overhead_seconds(0, load)
        if kind == "sequential":
            return self.forward_seconds(load * (k + 1)) + self.draft_seconds(k) + \
                self.overhead_seconds(k, load)
        verify = self.forward_seconds(load * ((k if kind == "carried" else 0) + 1))
        draft = self.draft_seconds(k + 1)
        share = self.exposed_share(load)
        if share is None:  # nothing measured yet: the overlap is assumed whole
            return max(verify, draft) + self.overhead_seconds(k, load)
        return max(verify, draft) + share * min(verify, draft) + self.overhead_seconds(0, load)

    def forward_seconds(self, batch_tokens: float) -> float:
        """The verifier's forward when its batch feeds batch_tokens tokens."""
        if not self.verify:
            return 1.0  # nothing measured: only ratios to t(1) matter until then
        base, slope = self.verify.fit(self.prior_slope)
        return max(1e-6, base + slope * (batch_tokens - 1))

    def draft_seconds(self, num_tokens: int) -> float:
        """A draft call of num_tokens tokens (0: no call)."""
        if num_tokens <= 0:
            return 0.0
        if not self.draft:
            return 0.1 * num_tokens * self.forward_seconds(1)
        sizes = self.draft.confirmed()
        if len(sizes) == 1:  # one size: all of it per token (dear for long K)
            n = sizes[0]
            return self.draft.points[n].value * num_tokens / n
        per_call, per_token = self.draft.fit(0.0)
        # the fit's a is the time at n = 1: split into a call's part and a token's
        return max(1e-6, per_call - per_token + per_token * num_tokens)

    def overhead_seconds(self, k: int = 1, load: float = 1.0) -> float:
        """A round's time beyond the pools' compute, with a draft call (k > 0) or without,
        at the load measured nearest to `load`."""
        drafting = nearest(self.overhead, load) or 0.0
        if k > 0:
            return drafting
        plain = nearest(self.overhead_plain, load)
        if plain is not None:
            return plain
        return max(0.0, drafting - (self.draft_hop.value or 0.0))


def nearest(by_bucket: dict[int, Recent], load: float, least: int = 1) -> float | None:
    """The value kept for the load bucket nearest to `load`'s among those with at least
    `least` values (the lower on a tie); None when there is none."""
    bucket = load_bucket(load)
    measured = [(abs(b - bucket), b) for b, recent in by_bucket.items()
                if len(recent.values) >= least]
    return by_bucket[min(measured)[1]].value if measured else None


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
    router-wide acceptance as a prior worth `prior_weight` positions. The load is the
    verifier batch this request's own recent rounds were scored in (1 until it has seen one):
    a request that starts after a burst drafts at once.
    """

    explore_every = 8  # rounds between two runs of a neighbouring K
    zero_load = 1.5  # K = 0 only in verifier batches at least this large on average...
    useless_alpha = 0.1  # ...or when this request's draft is accepted less than this...
    min_tested = 16  # ...over at least this many positions tested by this request
    margin = 0.1  # K = 0 is entered when it beats the best K by this much, left likewise
    # under load: rounds of the router per phase (a request's first round in a phase runs
    # the block drafted at the K before: at 16 streams a phase gives each five clean
    # rounds), and phases between two that explore
    batch_rounds, batch_explore_every = 96, 4
    # rounds between two choices (the costs and α move slowly; a choice weighs every K,
    # which on a router serving 16 streams was a tenth of its time per round)
    choose_every = 4

    def __init__(self, bounds: KBounds, costs: CostModel, pipelined: bool, greedy: bool,
                 prior_alpha: float = 0.6, prior_weight: float = 4.0,
                 decay: float = 0.85) -> None:
        self.bounds, self.costs = bounds, costs
        self.pipelined, self.greedy = pipelined, greedy
        prior = costs.alpha.value if costs.alpha.value is not None else prior_alpha
        self.accepted, self.tested = prior * prior_weight, prior_weight
        self.decay = decay
        self.positions_tested = 0  # by this request's own rounds, not the prior
        self.load = 1.0
        self.loaded = False  # the last round chose the router's K under load
        self.phase = 0  # ...in this phase of the router's (BatchTrials)
        self.rounds = 0
        self.explored_up = False
        self.chosen = self.choose(None) if bounds.initial is None else \
            min(max(bounds.initial, bounds.min), bounds.max)
        self.k = self.chosen

    @property
    def alpha(self) -> float:
        """The request's own acceptance; under batch load the router's (the requests of a
        batch then run one K: a batch is as long as its longest draft, and requests that
        each pick their own split it into cohorts)."""
        if self.load >= self.zero_load and self.costs.alpha.value is not None:
            return self.costs.alpha.value
        return self.accepted / self.tested

    def num_speculative_tokens(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int, cost: RoundCost | None = None) -> None:
        if num_drafted:
            tested = num_accepted + (num_accepted < num_drafted)
            self.accepted = self.decay * self.accepted + num_accepted
            self.tested = self.decay * self.tested + tested
            self.positions_tested += tested
            self.costs.alpha.add(num_accepted / tested)
        if cost is not None:
            self.load = 0.5 * self.load + 0.5 * max(1, cost.batch_size)
            self.costs.observe(cost)
        self.rounds += 1
        if self.load >= self.zero_load:
            if self.loaded and cost is not None and cost.comparable:
                self.costs.trials.record(self.phase, self.k, cost.tokens, cost.wall_seconds)
            self.k, self.phase = self.batch_k()
            self.chosen, self.loaded = self.k, True
            return
        if self.rounds % self.choose_every == 0 or self.loaded:  # or the load just fell
            self.chosen = self.choose(self.chosen)
            self.loaded = False
        self.k = self.explore(self.chosen) if self.rounds % self.explore_every == 0 \
            else self.chosen

    def batch_k(self) -> tuple[int, int]:
        """Under batch load: (the router's K, which every loaded request runs, the phase it
        was given in). The model chooses it first; after that it moves to a K whose trials
        (BatchTrials) beat it by `margin`. One phase of `batch_rounds` rounds in every
        `batch_explore_every` tries, for the whole batch at once, K + 1, K - 1 and K = 0 in
        turn, so the batch never mixes K (measured, 16 streams each choosing its own K ran
        at 0.55x of them all at the K most chose)."""
        trials = self.costs.trials
        if trials.k is None:
            trials.switch(self.choose(None))
        elif trials.rounds % self.choose_every == 0:
            # the trials decide once they have judged a K; till then the model, which must
            # promise `margin` more to move the whole batch (a change costs every request a
            # round of transition)
            better = trials.better(self.margin) if trials.judged else self.choose(trials.k)
            if better is not None and better != trials.k and (  # (choose's K = 0 has its own)
                    trials.judged or 0 in (better, trials.k)
                    or self.rate(better) > (1 + self.margin) * self.rate(trials.k)):
                trials.switch(better)
        trials.rounds += 1
        phase = trials.rounds // self.batch_rounds
        low = 0 if self.zero_allowed() else max(1, self.bounds.min)
        k = min(max(trials.k, low), self.bounds.max)
        if phase % self.batch_explore_every != self.batch_explore_every - 1:
            return k, phase
        # in turn: one up, one down, and K = 0 itself (the choice that load may call for,
        # however far the K in force is from it)
        turn = phase // self.batch_explore_every % 3
        tried = k + 1 if turn == 0 or k <= low else k - 1 if turn == 1 else low
        return min(max(tried, low), self.bounds.max), phase

    def explore(self, k: int) -> int:
        """A neighbour of k: one up and one down in turn, within what may be chosen."""
        low = 0 if self.zero_allowed() else max(1, self.bounds.min)
        self.explored_up = not self.explored_up
        step = 1 if self.explored_up or k <= low else -1
        return min(max(k + step, low), self.bounds.max)

    def zero_allowed(self) -> bool:
        if self.bounds.min > 0:
            return False
        useless = self.positions_tested >= self.min_tested and self.alpha < self.useless_alpha
        return self.load >= self.zero_load or useless

    def choose(self, current: int | None = None) -> int:
        """The best K, where K = 0 must win by `margin` to be entered or kept."""
        low = max(1, self.bounds.min)
        if low > self.bounds.max:
            return 0
        best = max(range(low, self.bounds.max + 1), key=self.rate)
        if not self.zero_allowed():
            return best
        plain, drafting = self.rate(0), self.rate(best)
        if current == 0:
            return 0 if drafting <= plain * (1 + self.margin) else best
        return 0 if plain > drafting * (1 + self.margin) else best

    def rate(self, k: int) -> float:
        """Expected tokens per second at K = k."""
        costs, alpha = self.costs, self.alpha
        if k == 0:
            return 1.0 / costs.round_seconds("plain", 0, self.load)
        tokens = expected_tokens(alpha, k)
        if not self.pipelined:
            return tokens / costs.round_seconds("sequential", k, self.load)
        return self.pipelined_rate(k, tokens)

    def pipelined_rate(self, k: int, tokens: float) -> float:
        """Pipelined rounds come in two kinds: one with pre-drafted candidates (carried)
        verifies K beside a pre-draft of K + 1, and is followed by another such round when
        its block and y1 are accepted (a = α^(K+1)); one without (fresh, after a rejection)
        verifies no draft beside a fresh draft of K + 1, makes one token, and is followed by
        a round with candidates when y1 is accepted (α). Over many rounds the first kind is
        α / (1 - a) times as frequent as the second."""
        costs, alpha = self.costs, self.alpha
        carried = costs.round_seconds("carried", k, self.load)
        fresh = costs.round_seconds("fresh", k, self.load)
        used = alpha ** (k + 1)
        return (alpha * tokens + (1 - used)) / (alpha * carried + (1 - used) * fresh)


def k_policy(k: int | str, pipelined: bool, greedy: bool, bounds: KBounds | None = None,
             costs: CostModel | None = None) -> KPolicy:
    """FixedK(k), or for k == "auto" an AdaptiveK in `bounds` learning into `costs`."""
    if k != "auto":
        return FixedK(k)
    return AdaptiveK(bounds or KBounds(), costs or CostModel(), pipelined, greedy)
