"""engine.kv.Sequence.counted keeps one SeenTokens per sequence, keyed by what it counts: the
prompt's length and whether the prompt's ids are marked (a repetition penalty reads them, the
frequency and presence penalties do not). A call that asks with another key is counted anew,
never from a SeenTokens made for the other key (which would leave the prompt's ids unmarked,
and the repetition penalty off for them)."""

from engine.kv import Sequence
from speculative.types import PrefixSync


def test_a_call_that_marks_the_prompt_is_not_served_the_unmarked_counts():
    sequence = Sequence()
    sequence.apply(PrefixSync(0, 0, (7, 8, 9, 5)))  # prompt 7, 8, 9; output 5
    unmarked = sequence.counted(3, False)
    assert (unmarked.columns.tolist(), unmarked.prompted.tolist()) == ([5], [False])
    marked = sequence.counted(3, True)
    assert (marked.columns.tolist(), marked.counts.tolist(), marked.prompted.tolist()) == \
        ([5, 7, 8, 9], [1, 0, 0, 0], [False, True, True, True])
    again = sequence.counted(3, False)
    assert (again.columns.tolist(), again.prompted.tolist()) == ([5], [False])
