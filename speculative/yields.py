"""What rounds yielded (tokens committed over wall seconds), where the adaptive K judges by
yield instead of by its cost model: the batch's K trials under load (`BatchTrials`) and
chains against trees at one node budget (`ShapeYields`). Both live in a router's CostModel
(speculative.costs), shared by its requests."""

import math
from collections import deque


class BatchTrials:
    """Under batch load every request runs the router's one K (`k`), in phases of rounds;
    some phases try another K for the whole batch. A tried K is judged by its phase's yield
    (tokens committed over the rounds' wall seconds) against the phases just before and just
    after it, at the K in force: the load drifts as requests start and end, and a phase's
    yield moves with it (measured at 16 streams: 30 % within a run, more than the
    differences between K = 0, 1 and 2), which an average over time would take for the K.

    A tried K whose trials keep losing is tried less often: each trial it loses adds a loss
    (at most `most_losses`), each it wins takes one away, and with n losses it sits out its
    next 2^n - 1 turns; a change of the K in force gives every K every turn again. A trial
    wins only by `margin`, the gain a switch asks for: one that gains less cannot move the
    batch, and each trial costs every request a round of transition (a K back from 0 has
    its drafter catch up the whole prefix). Measured at 16 streams with K = 0 in force, the
    trials of K = 1 ran a fifth of the rounds and kept losing; a win by noise (one trial's
    ratio to its neighbours ranged 0.48-1.05 for K = 1) took the back-off away at once when
    a win reset it."""

    most_losses = 2  # (then a losing K runs one turn in four)
    margin = 0.1  # a trial wins by this much: AdaptiveK.margin, the gain a switch asks for

    def __init__(self, keep: int = 4) -> None:
        self.k: int | None = None  # the K in force (None: not chosen yet)
        self.rounds = 0  # rounds run under batch load
        self.phase = 0  # the phase being assigned, and its rounds still to assign
        self.phase_left = 0
        self.in_phase: set = set()  # the requests that ran a round of it...
        self.joined: set = set()  # ...and those of them whose first round here it held
        self.judged = False  # whether a trial has been judged (then trials move K, not a model)
        self.open: dict[int, list] = {}  # phase -> [K, tokens, seconds] while it runs
        self.newest = -1
        self.closed: deque[tuple[int, int, float]] = deque(maxlen=3)  # (phase, K, yield)
        # per tried K, its phases' yields over their neighbours', since the K last changed
        self.ratios: dict[int, deque[float]] = {}
        self.keep = keep
        self.losses: dict[int, int] = {}  # per tried K, its trials lost in a row
        self.skips: dict[int, int] = {}  # per tried K, the turns it still sits out
        self.planned: tuple[int, bool] = (-1, False)  # (phase, whether its trial runs)
        self.drafting: int | None = None  # the K > 0 in force last (AdaptiveK.batch_k)

    def next_round(self, request, least: int, per_request: int, joined: bool = False) -> int:
        """The phase a round of `request` (the object itself: an id outlives a request that
        ended, and a new one may take it) is assigned to; joined: its first round under
        these trials. A phase lasts `least` rounds, or `per_request` rounds of each request
        that ran in the phase before, whichever is more: a request's first round in a phase
        runs the block drafted at the K before (pipelined), so at 128 streams a phase of 96
        rounds held no second round of any request, and a trial's yield was mostly the K
        before's. Those that joined in it are not counted: they stand for those that ended
        in it, so the count is the requests running. (Counting both, 16 streams of requests
        of 3 rounds made each phase twice the one before, the batch at one K for ever.)"""
        if self.phase_left <= 0:
            if self.rounds:
                self.phase += 1
            self.phase_left = max(least, per_request * len(self.in_phase - self.joined))
            self.in_phase, self.joined = set(), set()
        self.phase_left -= 1
        self.in_phase.add(request)
        if joined:
            self.joined.add(request)
        self.rounds += 1
        return self.phase

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
            ratio = 2 * y1 / (y0 + y2)
            self.ratios.setdefault(k1, deque(maxlen=self.keep)).append(ratio)
            self.judged = True
            losses = self.losses.get(k1, 0)
            self.losses[k1] = max(losses - 1, 0) if ratio > 1 + self.margin else \
                min(losses + 1, self.most_losses)
            self.skips[k1] = 2 ** self.losses[k1] - 1

    def runs_trial(self, phase: int, k: int) -> bool:
        """Whether exploring phase `phase` tries K = k, its turn's K, or runs the K in force:
        decided by the phase's first round, so every request of the phase runs the same K."""
        if self.planned[0] != phase:
            skip = self.skips.get(k, 0) > 0
            if skip:
                self.skips[k] -= 1
            self.planned = (phase, not skip)
        return self.planned[1]

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
        if self.k:
            self.drafting = self.k
        self.k = k
        self.ratios.clear()
        self.losses.clear()
        self.skips.clear()


class ShapeYields:
    """Per node budget K: the yield (tokens committed over wall seconds) of the sequential
    rounds that verified a chain of K and of those that verified a tree of K nodes, each
    over its recent rounds (decayed sums), for the adaptive K's choice between the shapes
    (AdaptiveK.round_shape). Both kinds run at the same budget, so a yield compares what
    the verify costs alike: a tree drafts fewer steps and may accept more or less."""

    least = 4  # rounds of a shape at a budget before its yield is trusted

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.sums: dict[tuple[int, bool], list[float]] = {}  # (K, tree): tokens, s, rounds
        self.refused = False  # the verifier scores no tree (AdaptiveK.refuse_trees): chains
        # the decayed count of `least` rounds in a row
        self.trusted = (1 - decay ** self.least) / (1 - decay) - 1e-9

    def record(self, budget: int, tree: bool, tokens: int, seconds: float) -> None:
        entry = self.sums.setdefault((budget, tree), [0.0, 0.0, 0.0])
        for i, value in enumerate((tokens, seconds, 1.0)):
            entry[i] = self.decay * entry[i] + value

    def rate(self, budget: int, tree: bool) -> float | None:
        """Tokens per second of this shape's rounds at this budget (None: too few)."""
        entry = self.sums.get((budget, tree))
        if entry is None or entry[2] < self.trusted:
            return None
        return entry[0] / entry[1]
