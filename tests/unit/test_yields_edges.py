"""What rounds yielded (speculative.yields) and the learnt confidence cut
(speculative.confidence) at their edges."""

from speculative.confidence import ConfidenceCut
from speculative.yields import BatchTrials


def test_the_k_drafted_at_last_survives_a_stay_at_k_zero():
    """drafting is the K > 0 in force last: from 2 to 0 and then to 1, it stays 2 (a K of
    0 drafts nothing for the trials to come back to)."""
    trials = BatchTrials()
    trials.switch(2)
    trials.switch(0)
    assert trials.drafting == 2
    trials.switch(1)
    assert trials.drafting == 2 and trials.k == 1


def test_a_cut_that_only_breaks_even_is_no_cut():
    """Buckets whose tokens gain exactly what they cost (here the prior's, at a bar of one
    token and no margin): a cut gains nothing, so nothing is cut."""
    cut = ConfidenceCut()
    cut.margin = 0.0
    assert cut.threshold(tokens_per_second=1.0, token_seconds=1.0) == 0.0
