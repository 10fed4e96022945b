"""How much of a pipelined round's shorter part ran beside its longer one (speculative.costs).

A pipelined round verifies beside a draft: it takes max(t, d) + λ min(t, d) + h, where λ is
the share of the shorter part that did not overlap and h the round's time beyond compute.
A round shows only its sum: its time beyond the longer part, y = h + λ x, at x = min(t, d).
The two come apart across rounds of different x (a neighbouring K drafts a longer or shorter
block): `Overlap` keeps the recent rounds and fits y against x through the median of each
kind of round (its K and how it ran), weighted by how often that kind ran, so a stray round
moves nothing. Rounds of one kind alone leave λ unknown: their y is then h and λ x together,
right at their own x; the cost model uses it at every K (λ taken as 0) until rounds at a
neighbouring K spread x, which exploration brings within a few rounds. (Filed as h for
good, the y of the rounds at the K in force would make λ measure about 0 and a longer draft
look free.)
"""

from collections import deque
from statistics import median_low

# below this spread of the kinds' x (seconds, weighted), the fit is noise: λ unknown
MIN_SPREAD_S = 1e-4


class Overlap:
    def __init__(self, size: int = 64) -> None:
        self.points: deque[tuple[tuple, float, float]] = deque(maxlen=size)
        self.fitted: tuple[float, float | None] | None = None  # until the next add

    def add(self, kind: tuple, shorter: float, beyond: float) -> None:
        """A round of this kind (hashable: how it ran and its sizes), its shorter part and
        its time beyond the longer one, in seconds."""
        self.points.append((kind, shorter, beyond))
        self.fitted = None

    @property
    def values(self) -> deque:  # (as speculative.costs.Recent's, for costs.nearest)
        return self.points

    @property
    def value(self) -> tuple[float, float | None]:
        return self.fit()

    def fit(self) -> tuple[float, float | None]:
        """(h, λ): λ in [0, 1], or None where the rounds' x do not spread enough to tell."""
        if self.fitted is None:
            self.fitted = self._fit()
        return self.fitted

    def _fit(self) -> tuple[float, float | None]:
        by_kind: dict[tuple, list[tuple[float, float]]] = {}
        for kind, x, y in self.points:
            by_kind.setdefault(kind, []).append((x, y))
        kinds = [(median_low([x for x, _ in rounds]), median_low([y for _, y in rounds]),
                  len(rounds)) for rounds in by_kind.values()]
        total = sum(n for _, _, n in kinds)
        mean_x = sum(x * n for x, _, n in kinds) / total
        mean_y = sum(y * n for _, y, n in kinds) / total
        spread = sum(n * (x - mean_x) ** 2 for x, _, n in kinds)
        if spread < total * MIN_SPREAD_S ** 2:
            return max(0.0, mean_y), None
        slope = sum(n * (x - mean_x) * (y - mean_y) for x, y, n in kinds) / spread
        share = min(1.0, max(0.0, slope))
        return max(0.0, mean_y - share * mean_x), share
