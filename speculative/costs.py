"""What a round costs, as the K policy measures it (speculative.policy).

`RoundCost` is one round's measured parts, `CostModel` keeps them per load bucket: the
verify and draft lines (`Curve`, each point the median of its recent values), the overhead
beyond compute, the overlap λ of pipelined rounds, the acceptance prior, and the batch's
K trials per load band (`BatchTrials`, speculative.yields). See speculative.policy for how
they choose K.
"""

import logging
import math
from collections import deque
from dataclasses import dataclass
from statistics import median_low

from speculative.confidence import ConfidenceCut
from speculative.overlap import Overlap
from speculative.yields import BatchTrials, ShapeYields

log = logging.getLogger(__name__)

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
    steps: int = 1  # the verifier's forwards for a round without a draft (verifier.steps)
    # the drafter's batch that drafted draft_tokens: its calls (0: unknown, batch_size's)
    draft_batch_size: int = 0
    carried: bool = False  # its block was pre-drafted beside the round before's verify


# plain: no draft; sequential: draft, then verify; carried: verify of a pre-drafted block
# beside a pre-draft of K + 1; fresh: verify of no draft beside a fresh draft of K + 1
ROUND_KINDS = ("plain", "sequential", "carried", "fresh")
BESIDE = ("carried", "fresh")


def load_bucket(batch_size: float) -> int:
    """Verifier batches of about the same size (powers of two) share their overlap."""
    return round(math.log2(batch_size)) if batch_size > 1.0 else 0


def load_band(load: float) -> int:
    """Loads that run one K under batch load (each band its own BatchTrials): a factor of 4
    wide, [1.5, 6), [6, 24), [24, 96), ... calls a batch. Measured on the demo pair: a K = 1
    that the trials chose at 4 streams, kept at 16, made 0.8x of K = 0's tokens there. The
    edges lie between the powers of two a pool's max_batch_size is set to: at an edge (32
    was one), the load of a full pool straddles it and its requests split between two
    bands' trials, each judging half as often."""
    return math.floor(math.log(load / 1.5, 4)) + 1 if load >= 1.5 else 0


class Acceptance:
    """The drafted tokens accepted per position tested, over recent rounds (decayed sums;
    None before the first round that tested one). A ratio of sums, not a mean of each
    round's ratio: a round that rejects its first token tests one position and one that
    accepts all tests K, so the mean of ratios weighs early rejections K times too much
    (i.i.d. acceptance 0.7 at K = 4: 0.52)."""

    def __init__(self, decay: float, accepted: float = 0.0, tested: float = 0.0) -> None:
        """accepted, tested: a prior, worth `tested` positions."""
        self.decay, self.accepted, self.tested = decay, accepted, tested

    def add(self, accepted: int, tested: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.tested = self.decay * self.tested + tested

    @property
    def value(self) -> float | None:
        return self.accepted / self.tested if self.tested > 0 else None


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


# sizes a Curve keeps. The verify line's sizes are its batches' fed tokens, which a prompt's
# prefill chunk sets to any value: kept all, a router's line grew by a size per new value
# for good (20,000 rounds of varied prompts: 12,673 sizes, and a fit, run after every add,
# took 36 ms); past the bound the size seen least lately goes, which the fit weighs least
MAX_SIZES = 256


class Curve:
    """Times by size (tokens): a median per size and how often each size was seen lately,
    fitted with a weighted line a + b (n - 1); b >= 0 (noise must not make more tokens look
    cheaper). At most MAX_SIZES sizes are kept."""

    def __init__(self, decay: float = 0.02) -> None:
        self.points: dict[int, Recent] = {}
        # decayed counts, how common each size is now, relative to one another: each add
        # weighs 1 / (1 - decay) times the one before (the same ratios as decaying every
        # count on every add, which costs a pass over the sizes), rescaled now and then
        self.seen: dict[int, float] = {}
        self.weight = 1.0  # of the next add
        self.decay = decay
        self.fitted: dict[float, tuple[float, float]] = {}  # by prior slope, until an add

    def add(self, size: int, seconds: float) -> None:
        if size not in self.points and len(self.points) >= MAX_SIZES:
            rarest = min(self.seen, key=self.seen.get)
            del self.points[rarest], self.seen[rarest]
        add_to(self.points, size, seconds)
        self.seen[size] = self.seen.get(size, 0.0) + self.weight
        self.weight /= 1 - self.decay
        if self.weight > 1e100:
            self.seen = {n: count / self.weight for n, count in self.seen.items()}
            self.weight = 1.0
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
        fitted = self.fitted.get(prior_slope)
        if fitted is None:
            fitted = self.fitted[prior_slope] = self._fit(prior_slope)
        return fitted

    def _fit(self, prior_slope: float) -> tuple[float, float]:
        sizes = self.confirmed()
        anchor = 1 if 1 in sizes else max(sizes, key=self.seen.get)
        base = self.points[anchor].value
        # a size unseen for tens of thousands of adds weighs 0.0 after a rescale: none
        others = [(n, self.points[n].value, self.seen[n]) for n in sizes
                  if n != anchor and self.seen[n] > 0]
        if others:
            slope = sum(w * (t - base) / (n - anchor) for n, t, w in others) / \
                sum(w for _, _, w in others)
            slope = max(0.0, slope)
        else:
            slope = prior_slope * base / (1 + prior_slope * (anchor - 1))
        return max(1e-6, base - slope * (anchor - 1)), slope


# the first draft costs, then every this many, are checked for no room for speculation
ROOM_CHECK_EVERY = 32

# a drafter fed more committed tokens than a round's usual (its last draft token and the
# bonus) was catching up after rounds without a draft
USUAL_CATCH_UP = 2


class CostModel:
    """The pools' costs as warm rounds measure them, shared by a router's requests.

    Verify: the forward's time as a line in the tokens its batch feeds (a new machine's curve
    is learnt, not configured); until two sizes are seen the slope is `prior_slope` of t(1)
    per extra token. Draft: a call's time as a per-call part plus a per-token part, a line
    per load bucket of the drafter's batches (a call's time is its batch's: measured on the
    demo pair, a draft of one token took 2 ms alone and 18-38 ms among a burst's; one line
    for both made a lone request after a burst take drafts for dear per call and free per
    token, and draft K = 8 at an acceptance of 0.38). Overheads: a round's time beyond the
    pools' compute, with a draft call and without.
    """

    def __init__(self, prior_slope: float = 0.1, router_side: bool = False) -> None:
        self.prior_slope = prior_slope
        self.verify = Curve()
        self.drafts: dict[int, Curve] = {}  # the draft line by load bucket
        # a round's time beyond compute, with a draft call and without, by load bucket (under
        # load it holds the waits of the batch cycle)
        self.overhead: dict[int, Recent] = {}
        self.overhead_plain: dict[int, Recent] = {}
        self.draft_hop: dict[int, Recent] = {}  # by load bucket, as the draft line
        # acceptance across requests: a new request's prior, every request's under load
        self.alpha = Acceptance(0.95)
        # by load band: the K of every request under batch load, tried
        self.trials: dict[int, BatchTrials] = {}
        self.confidence = ConfidenceCut()  # where a draft's block pays no more
        self.shapes = ShapeYields()  # chains against trees at one node budget
        # a pipelined round's time beyond its longer part (h + λ x: speculative.overlap),
        # by load bucket
        self.overlap: dict[int, Overlap] = {}
        self.warned = False
        # the router drafts itself (model-free: no pool contends for the cores, no catch-up
        # after rounds without a draft), so the model may move a batch's K either way
        self.router_side = router_side
        self.draft_adds = 0  # draft costs observed (the warning is checked on some)

    def trials_at(self, load: float) -> BatchTrials:
        """The batch trials of this load's band (load_band). (Asked every loaded round: a
        setdefault would build a BatchTrials each time.)"""
        band = load_band(load)
        trials = self.trials.get(band)
        if trials is None:
            trials = self.trials[band] = BatchTrials()
        return trials

    def no_room_for_speculation(self) -> float | None:
        """c = a one-token draft over a one-token verify, once both are measured, when it
        leaves no room for speculation (c >= 1: even a fully accepted K = 1 round makes two
        tokens in at least two verifies' time); else None."""
        if not self.verify or not self.draft_line(1.0):
            return None
        ratio = self.draft_seconds(1) / self.forward_seconds(1)
        return ratio if ratio >= 1.0 else None

    def observe(self, cost: RoundCost) -> None:
        if not cost.comparable:
            return
        if cost.verify_tokens > 0 and cost.verify_seconds > 0:
            self.verify.add(cost.batch_tokens or cost.verify_tokens, cost.verify_seconds)
        draft_bucket = load_bucket(cost.draft_batch_size or cost.batch_size)
        if cost.draft_tokens > 0 and cost.draft_seconds > 0 \
                and cost.draft_catch_up <= USUAL_CATCH_UP:
            line = self.drafts.setdefault(draft_bucket, Curve())
            line.add(cost.draft_tokens, cost.draft_seconds)
            self.draft_adds += 1
            checked = self.draft_adds <= ROOM_CHECK_EVERY or \
                self.draft_adds % ROOM_CHECK_EVERY == 0  # (a check costs both lines' fits)
            ratio = None if self.warned or not checked else self.no_room_for_speculation()
            if ratio is not None:
                self.warned = True
                log.warning("a draft step costs %.2fx a verify on these pools: speculation "
                            "cannot pay (an adaptive K runs K = 0 where its bounds and load "
                            "allow it); pair a cheaper drafter or a faster drafter class",
                            ratio)
        bucket = load_bucket(cost.batch_size)
        if cost.draft_hop_seconds > 0:
            add_to(self.draft_hop, draft_bucket, cost.draft_hop_seconds)
        if cost.kind in BESIDE:  # its time beyond compute holds the part that did not overlap
            shorter = min(cost.verify_seconds, cost.draft_seconds)
            if cost.wall_seconds > 0 and shorter > 0:
                overlap = self.overlap.get(bucket)
                if overlap is None:
                    overlap = self.overlap[bucket] = Overlap()
                overlap.add((cost.kind, cost.verify_tokens, cost.draft_tokens), shorter,
                            max(0.0, cost.overhead_seconds))
        elif cost.steps <= 1:  # (a round of several steps also waits between its steps)
            add_to(self.overhead_plain if cost.verify_tokens <= 1 else self.overhead, bucket,
                   max(0.0, cost.overhead_seconds))

    def beside(self, load: float) -> tuple[float, float | None] | None:
        """(h, λ) of pipelined rounds at this load (speculative.overlap; the nearest load
        with two rounds measured), or None before them."""
        return nearest(self.overlap, load, least=2)

    def exposed_share(self, load: float) -> float | None:
        """λ at this load (None before pipelined rounds that tell it)."""
        fitted = self.beside(load)
        return None if fitted is None else fitted[1]

    def round_seconds(self, kind: str, k: int, load: float) -> float:
        """A round of this kind at K = k when the verifier's batches hold `load` calls, each
        at this K (ROUND_KINDS; the module's formulas)."""
        if kind == "plain":
            return self.forward_seconds(load) + self.overhead_seconds(0, load)
        if kind == "sequential":
            return self.forward_seconds(load * (k + 1)) + self.draft_seconds(k, load) + \
                self.overhead_seconds(k, load)
        verify = self.forward_seconds(load * ((k if kind == "carried" else 0) + 1))
        draft = self.draft_seconds(k + 1, load)
        fitted = self.beside(load)
        if fitted is None:  # nothing measured yet: the overlap is assumed whole
            return max(verify, draft) + self.overhead_seconds(k, load)
        beyond, share = fitted  # (λ unknown: the rounds' own time beyond, λ x with it)
        return max(verify, draft) + (share or 0.0) * min(verify, draft) + beyond

    def forward_seconds(self, batch_tokens: float) -> float:
        """The verifier's forward when its batch feeds batch_tokens tokens."""
        if not self.verify:
            return 1.0  # nothing measured: only ratios to t(1) matter until then
        base, slope = self.verify.fit(self.prior_slope)
        return max(1e-6, base + slope * (batch_tokens - 1))

    def draft_line(self, load: float) -> Curve | None:
        """The draft line of the load bucket nearest to `load`'s (None before any draft)."""
        bucket = nearest_bucket(self.drafts, load)
        return None if bucket is None else self.drafts[bucket]

    def draft_seconds(self, num_tokens: int, load: float = 1.0) -> float:
        """A draft call of num_tokens tokens (0: no call) when the drafter's batches hold
        about `load` calls."""
        if num_tokens <= 0:
            return 0.0
        line = self.draft_line(load)
        if line is None:
            return 0.1 * num_tokens * self.forward_seconds(1)
        sizes = line.confirmed()
        if len(sizes) == 1:  # one size: all of it per token (dear for long K)
            n = sizes[0]
            return line.points[n].value * num_tokens / n
        per_call, per_token = line.fit(0.0)
        # the fit's a is the time at n = 1: split into a call's part and a token's
        return max(1e-6, per_call - per_token + per_token * num_tokens)

    def draft_call_seconds(self, load: float = 1.0) -> float:
        """What waiting for a draft call adds to a round beyond the draft's compute: as the
        rounds that waited for one measured it, else a pool call's share of a round without
        a draft (one call, as a draft's is)."""
        hop = nearest(self.draft_hop, load)
        return hop if hop is not None else self.overhead_seconds(0, load)

    def token_seconds(self) -> float:
        """What one more drafted token costs a round: a draft step and one more token in the
        verifier's batch (the lines' slopes; speculative.confidence)."""
        verify = self.forward_seconds(2) - self.forward_seconds(1)
        return verify + self.draft_seconds(2) - self.draft_seconds(1)

    def overhead_seconds(self, k: int = 1, load: float = 1.0) -> float:
        """A round's time beyond the pools' compute, with a draft call (k > 0) or without,
        at the load measured nearest to `load`; where that kind of round has not run, a
        verify call's (plain rounds', else pipelined rounds' h) and a draft call's hop."""
        drafting = nearest(self.overhead, load)
        if k > 0 and drafting is not None:
            return drafting
        plain = nearest(self.overhead_plain, load)
        if plain is None:  # a verify call's own: the pipelined rounds' h, where they ran
            fitted = self.beside(load)
            plain = None if fitted is None else fitted[0]
        hop = nearest(self.draft_hop, load) or 0.0
        if plain is not None:
            return plain + (hop if k > 0 else 0.0)
        return max(0.0, (drafting or 0.0) - hop)


def add_to(by_bucket: dict[int, Recent], bucket: int, value: float) -> None:
    """value added to by_bucket[bucket] (a Recent made for the first)."""
    recent = by_bucket.get(bucket)
    if recent is None:
        recent = by_bucket[bucket] = Recent()
    recent.add(value)


def nearest(by_bucket: dict, load: float, least: int = 1):
    """The value kept for the load bucket nearest to `load`'s among those with at least
    `least` values (the lower on a tie); None when there is none. (Of Recent medians, or
    of anything with `values` and `value`: speculative.overlap.Overlap's fit.)"""
    recent = by_bucket.get(load_bucket(load))
    if recent is not None and len(recent.values) >= least:  # the load's own (a rate's
        return recent.value  # every K asks: no list built)
    bucket = nearest_bucket([b for b, recent in by_bucket.items()
                             if len(recent.values) >= least], load)
    return None if bucket is None else by_bucket[bucket].value


def nearest_bucket(buckets, load: float) -> int | None:
    """Of `buckets`, `load`'s own, else the nearest to it (the lower on a tie); None for
    none."""
    own = load_bucket(load)
    if own in buckets:
        return own
    return min(buckets, key=lambda b: (abs(b - own), b), default=None)


def expected_tokens(alpha: float, k: int) -> float:
    """E[N] = (1 - α^(K+1)) / (1 - α): a round's output for i.i.d. acceptance α."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)
