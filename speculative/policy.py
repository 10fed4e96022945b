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

"Beside" is measured, not assumed: a pipelined round takes max(t, d) + λ min(t, d) + h,
where λ is the share of the shorter part that did not overlap and h the round's time beyond
compute, both fitted to the pipelined rounds at about this load, across the Ks they ran
(speculative.overlap). On separate machines λ is near 0; where the pools share cores they
take turns and λ nears 1.
Costs stay those of a batch in which every request runs the K being weighed (t at B (K + 1)
tokens): under load a request's own round lasts as long as the batch cycle whatever its K,
so its own round times would make every K look free to it while its drafts slow everyone.
Under batch load every request runs the router's one K for its load's band (a factor of 4
wide: AdaptiveK.batch_k): measured at 16 streams, requests that each chose their own K
(mostly 1 to 3) made 0.6x the tokens of all at K = 2, as a drafter batch lasts as long as
its longest block. That K is then tried, not modelled: phases of the whole batch at another
K, each judged against the phases around it (speculative.yields.BatchTrials), decide it
once they have judged one.

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
- K = 0 (speculation off) is reachable only when it pays under batch load, or alone when
  the request's rounds without a draft run several steps (plain_steps) and its own
  acceptance is measured (or its draft is measured to be useless), with a margin to enter
  and to leave; alone it still explores K = 1 every `explore_every` rounds.

A policy also gives each draft call its draft_confidence: a fixed one, or, "auto" with an
adaptive K, the cut learnt into the shared costs (speculative.confidence).
"""

from dataclasses import dataclass

from speculative.costs import Acceptance, CostModel, RoundCost, expected_tokens
from speculative.fixed_k import FixedK, KPolicy
from speculative.yields import BatchTrials


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
    verifier batch this request's own recent rounds were scored in, at first the requests
    running beside it when it started (`load`): a request that starts under load runs the
    batch's K from its first round (K = 0: no drafter call at all), one that starts after a
    burst drafts at once.
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
    clean_rounds = 6  # ...and at least this many rounds of each request (BatchTrials)
    # rounds between two choices (the costs and α move slowly; a choice weighs every K,
    # which on a router serving 16 streams was a tenth of its time per round)
    choose_every = 4
    shape_explore_every = 8  # with trees: rounds between two runs of the other shape

    def __init__(self, bounds: KBounds, costs: CostModel, pipelined: bool, greedy: bool,
                 prior_alpha: float = 0.6, prior_weight: float = 4.0,
                 decay: float = 0.85, confidence: float | str | None = None,
                 trees: bool = False, load: float = 1.0, plain_steps: int = 1) -> None:
        self.bounds, self.costs = bounds, costs
        self.plain_steps = plain_steps  # the tokens a round without a draft asks for
        self.confidence = confidence  # draft_confidence: a number, "auto" (learnt) or None
        self.trees = trees  # choose between a chain of K and a tree of K nodes (round_shape)
        self.asked: tuple[int, bool] | None = None  # this round's (K, tree), once chosen
        self.pipelined, self.greedy = pipelined, greedy
        prior = costs.alpha.value if costs.alpha.value is not None else prior_alpha
        self.own = Acceptance(decay, prior * prior_weight, prior_weight)
        self.positions_tested = 0  # by this request's own rounds, not the prior
        self.load = max(1.0, load)
        self.loaded = False  # the last round chose the router's K under load
        self.phase = 0  # ...in this phase of the router's (BatchTrials)...
        self.trials: BatchTrials | None = None  # ...of these trials (its load's band)
        self.ran: tuple | None = None  # (trials, phase, K) of the round just run, if loaded
        self.rounds = 0
        self.explored_up = False
        self.chosen = self.first_k() if bounds.initial is None else \
            min(max(bounds.initial, bounds.min), bounds.max)
        self.k = self.chosen

    @property
    def alpha(self) -> float:
        """The request's own acceptance; under batch load the router's (the requests of a
        batch then run one K: a batch is as long as its longest draft, and requests that
        each pick their own split it into cohorts)."""
        if self.load >= self.zero_load and self.costs.alpha.value is not None:
            return self.costs.alpha.value
        return self.own.value

    def num_speculative_tokens(self) -> int:
        return self.k

    def draft_confidence(self) -> float | None:
        """The draft's cut (speculative.confidence): learnt when "auto", where it is 0 (no
        cut) under batch load, where the batch's one K rules, and on the rounds that run a
        neighbouring K, so that every confidence keeps being measured."""
        if self.confidence != "auto":
            return self.confidence
        if self.batched() or self.k != self.chosen:
            return 0.0
        return self.costs.confidence.threshold(self.rate(self.k), self.costs.token_seconds())

    def observe_confidences(self, confidences, num_accepted: int) -> None:
        if self.confidence == "auto":
            self.costs.confidence.observe(confidences, num_accepted)

    def round_shape(self, free: bool) -> tuple[int, int] | None:
        """With trees chosen per round, for a free round: (K - s, K), a tree of K nodes whose
        main chain is s shorter than the chain's (s = K // 8, at least 1: one sibling a
        level, where the draft is least sure; measured, the best tree of 8 nodes), when its
        sequential rounds at this K yield `margin` more than the chain's; else None (the
        chain). The other shape runs every `shape_explore_every` rounds (between the K
        explorations), so that both stay measured. The round is recorded under this choice
        (`asked`), whatever a confidence cut made of its draft. Chains under batch load and
        at K < 2."""
        self.asked = None
        if not free or not self.trees or self.batched() or self.k < 2 or \
                self.costs.shapes.refused:
            return None
        yields = self.costs.shapes
        tree_rate, chain_rate = yields.rate(self.k, True), yields.rate(self.k, False)
        tree = tree_rate is not None and chain_rate is not None and \
            tree_rate > (1 + self.margin) * chain_rate
        if self.rounds % self.shape_explore_every == self.shape_explore_every // 2:
            tree = not tree
        self.asked = (self.k, tree)
        return (self.k - max(1, self.k // 8), self.k) if tree else None

    def batched(self) -> bool:
        """Whether this round runs under batch load: as the last round's update found, and
        a first round of a request that starts under load (first_k: the router's K)."""
        return self.loaded or not self.rounds and self.load >= self.zero_load

    def refuse_trees(self) -> None:
        self.costs.shapes.refused, self.asked = True, None  # this round is no tree's either

    def update(self, num_drafted: int, num_accepted: int, cost: RoundCost | None = None) -> None:
        if num_drafted:
            tested = num_accepted + (num_accepted < num_drafted)
            self.own.add(num_accepted, tested)
            self.positions_tested += tested
            self.costs.alpha.add(num_accepted, tested)
        if cost is not None:
            self.load = 0.5 * self.load + 0.5 * max(1, cost.batch_size)
            self.costs.observe(cost)
            if self.asked is not None and cost.comparable and cost.kind == "sequential" \
                    and cost.wall_seconds > 0 and cost.batch_size <= 1:
                self.costs.shapes.record(*self.asked, cost.tokens, cost.wall_seconds)
        self.rounds += 1
        ran = (self.trials, self.phase, self.k) if self.loaded else None
        # the phase and K this round's block was drafted at: a pre-drafted (carried) one at
        # the round before's, beside whose verify it was drafted
        drafted_at = self.ran if cost is not None and cost.carried else ran
        self.ran = ran
        if self.load >= self.zero_load:
            if drafted_at is not None and cost is not None and cost.comparable:
                trials, phase, k = drafted_at
                trials.record(phase, k, cost.tokens, cost.wall_seconds)
            self.k, self.phase = self.batch_k()
            self.chosen, self.loaded = self.k, True
            return
        if self.rounds % self.choose_every == 0 or self.loaded:  # or the load just fell
            self.chosen = self.choose(self.chosen)
            self.loaded = False
        self.k = self.explore(self.chosen) if self.rounds % self.explore_every == 0 \
            else self.chosen

    def batch_k(self) -> tuple[int, int]:
        """Under batch load: (the router's K for this request's load band, which every
        loaded request of the band runs, the phase it was given in). The model chooses it
        first and may lower it (`lowered`); once a trial is judged, it moves to a K whose
        trials (BatchTrials) beat it by `margin`.
        One phase of `batch_rounds` rounds in every `batch_explore_every` tries, for the
        whole batch at once, K + 1, K - 1 and K = 0 in turn (a K whose trials keep losing
        sits some of its turns out), so the batch never mixes K (measured, 16 streams each
        choosing its own K ran at 0.55x of them all at the K most chose)."""
        trials = self.costs.trials_at(self.load)
        joined, self.trials = trials is not self.trials, trials
        if trials.k is None:
            trials.switch(self.choose(None))
            if trials.k == 0 and self.bounds.max > 0:
                # a band that starts without a draft tries the K the model drafts best by,
                # as one that drafted before tries its last K: from K = 0 trials of K = 1
                # alone lose to plain steps and kept a batch whose drafts were nearly all
                # accepted (a prediction's) at K = 0 for good
                trials.drafting = self.best_drafting()
        elif trials.rounds % self.choose_every == 0:
            # the trials decide once they have judged a K; till then the model, which must
            # promise `margin` more to move the whole batch (a change costs every request a
            # round of transition)
            better = trials.better(self.margin) if trials.judged else self.lowered(trials.k)
            if better is not None and better != trials.k and (  # (choose's K = 0 has its own)
                    trials.judged or 0 in (better, trials.k)
                    or self.rate(better) > (1 + self.margin) * self.rate(trials.k)):
                trials.switch(better)
        phase = trials.next_round(self, self.batch_rounds, self.clean_rounds, joined)
        low = self.lowest()
        k = self.within(trials.k)
        if phase % self.batch_explore_every != self.batch_explore_every - 1:
            return k, phase
        # in turn: one up, one down, and K = 0 itself (the choice that load may call for,
        # however far the K in force is from it); from the lowest, one up and the K the
        # batch drafted at last: K = 0's rounds of plain steps may beat K = 1 and lose to
        # K = 8 (measured at 128 streams, the model having moved the batch from 8 to 0: K = 1
        # tried 1.01-1.08x of K = 0, K = 8 2.6-3.9x, and the batch went back to 8)
        turn = phase // self.batch_explore_every % 3
        if k <= low:
            tried = self.within((trials.drafting or k + 1) if turn == 0 else k + 1)
        else:
            tried = self.within(k + 1 if turn == 0 else k - 1 if turn == 1 else low)
        return (tried if trials.runs_trial(phase, tried) else k), phase

    def lowered(self, k: int) -> int:
        """The model's K for a batch at K = k before its band's trials have judged one: it
        may only lower the K. Under load the model overrates a K: measured at 16 streams on
        2 cores, it moved a batch at K = 0 to K = 6-8, which made 0.7x of K = 0's tokens
        (the pools' contention for the cores and the rounds of transition are not in it);
        trials move the K up. A drafter the router runs itself has neither: its model moves
        the K either way (a prediction's batch, lowered to K = 0 by its first rounds'
        acceptance, stayed there while K = 4 ran 1.4-1.6x faster)."""
        return self.choose(k) if self.costs.router_side else min(self.choose(k), k)

    def first_k(self) -> int:
        """The first round's K: under batch load the router's K in force (BatchTrials), else
        the best the model expects."""
        if self.load < self.zero_load:
            return self.choose(None)
        k = self.costs.trials_at(self.load).k
        return self.choose(None) if k is None else self.within(k)

    def explore(self, k: int) -> int:
        """A neighbour of k: one up and one down in turn, within what may be chosen."""
        self.explored_up = not self.explored_up
        step = 1 if self.explored_up or k <= self.lowest() else -1
        return self.within(k + step)

    def lowest(self) -> int:
        """The smallest K that may be chosen now: 0 where zero_allowed, else the bounds'
        (at least 1)."""
        return 0 if self.zero_allowed() else max(1, self.bounds.min)

    def within(self, k: int) -> int:
        """k brought within what may be chosen now (lowest() to the bounds' max)."""
        return min(max(k, self.lowest()), self.bounds.max)

    def zero_allowed(self) -> bool:
        if self.bounds.min > 0:
            return False
        measured = self.positions_tested >= self.min_tested
        useless = measured and self.alpha < self.useless_alpha
        # alone, a round of several steps is a real rival to drafting (measured on the demo
        # pair at T = 1, alone: 214 tokens/s at K = 0 with 4 steps, 169 for the adaptive K);
        # one step never is, short of a useless draft. Not on the router's acceptance before
        # its own (tried: a default greedy request on a shared deployment whose other load
        # made drafts look dear then ran without a draft from its first round)
        return self.load >= self.zero_load or useless or measured and self.plain_steps > 1

    def choose(self, current: int | None = None) -> int:
        """The best K, where K = 0 must win by `margin` to be entered, and is kept until
        drafting wins by `margin`."""
        if max(1, self.bounds.min) > self.bounds.max:
            return 0
        best = self.best_drafting()
        if not self.zero_allowed():
            return best
        plain, drafting = self.rate(0), self.rate(best)
        if current == 0:
            return 0 if drafting <= plain * (1 + self.margin) else best
        return 0 if plain > drafting * (1 + self.margin) else best

    def best_drafting(self) -> int:
        """The K of at least 1 in the bounds with the most expected tokens per second."""
        return max(range(max(1, self.bounds.min), self.bounds.max + 1), key=self.rate)

    def rate(self, k: int) -> float:
        """Expected tokens per second at K = k."""
        costs, alpha = self.costs, self.alpha
        if k == 0:  # its steps' forwards, the round's overhead once (verifier.steps)
            steps = self.plain_steps
            return steps / (costs.round_seconds("plain", 0, self.load)
                            + (steps - 1) * costs.forward_seconds(self.load))
        tokens = expected_tokens(alpha, k)
        if not self.pipelined:
            return tokens / costs.round_seconds("sequential", k, self.load)
        return self.pipelined_rate(k, tokens)

    def pipelined_rate(self, k: int, tokens: float) -> float:
        """The rate of pipelined rounds at K = k, each round without candidates run the
        better of the two ways (restart_rates)."""
        return max(self.restart_rates(k, tokens))

    def restart_rates(self, k: int, tokens: float) -> tuple[float, float]:
        """(fresh, drafted): tokens per second of pipelined rounds at K = k over many rounds,
        when a round without candidates (after a rejection) runs fresh, and when it drafts
        first. A round with candidates (carried) verifies K beside a pre-draft of K + 1 and
        is followed by another when its block and y1 are accepted (a = α^(K+1)).
        - fresh: the round verifies no draft beside a fresh draft of K + 1, makes one token,
          and is followed by a carried round when y1 is accepted (α), so carried rounds are
          α / (1 - a) times as frequent as fresh ones;
        - drafted: the round waits for a draft of K (its compute and its call), then runs as
          a carried round does, followed by a carried round as often (a).
        Drafting first pays where a verify is dear against a draft (a fresh round spends a
        whole verify on one token). Under batch load only fresh: a request that drafted
        first would reach the verifier's batch a draft later than the others."""
        costs, alpha = self.costs, self.alpha
        carried = costs.round_seconds("carried", k, self.load)
        fresh = costs.round_seconds("fresh", k, self.load)
        used = alpha ** (k + 1)
        fresh_rate = (alpha * tokens + (1 - used)) / (alpha * carried + (1 - used) * fresh)
        if self.load >= self.zero_load:
            return fresh_rate, 0.0
        drafted = carried + costs.draft_seconds(k, self.load) + \
            costs.draft_call_seconds(self.load)
        return fresh_rate, tokens / (used * carried + (1 - used) * drafted)

    def restarts_fresh(self) -> bool:
        """See KPolicy: the better of the two at this round's K (restart_rates)."""
        if not self.pipelined or self.k <= 0 or self.load >= self.zero_load:
            return True
        fresh, drafted = self.restart_rates(self.k, expected_tokens(self.alpha, self.k))
        return fresh >= drafted


def k_policy(k: int | str, pipelined: bool, greedy: bool, bounds: KBounds | None = None,
             costs: CostModel | None = None, confidence: float | str | None = None,
             trees: bool = False, load: float = 1.0, plain_steps: int = 1) -> KPolicy:
    """FixedK(k), or for k == "auto" an AdaptiveK in `bounds` learning into `costs`.
    confidence: the draft calls' draft_confidence, or "auto" to learn it; trees: choose per
    round between a chain and a tree. Both "auto" and trees need an adaptive K and
    sequential rounds: a fixed K or a pipelined request (whose pre-drafts run beside the
    verify, at another cost, and continue one chain) leaves the cut to the pool and drafts
    chains; load: the requests running when this one starts, itself included (AdaptiveK);
    plain_steps: the tokens a round without a draft asks for (state.Request)."""
    if k != "auto":
        return FixedK(k, None if confidence == "auto" else confidence)
    if pipelined and confidence == "auto":
        confidence = None
    return AdaptiveK(bounds or KBounds(), costs or CostModel(), pipelined, greedy,
                     confidence=confidence, trees=trees and not pipelined,
                     load=load, plain_steps=plain_steps)
