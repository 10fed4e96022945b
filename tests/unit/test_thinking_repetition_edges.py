"""Edges of the thinking budget's section state and of repetition_detection's bounds: what
a plain steps call may feed before a forced id, a section's start ids read from the output
since the last close alone, and vLLM's refusals at their exact bounds."""

import pytest

from speculative.repetition import MAX_PATTERN_SIZE, RepetitionDetection
from speculative.thinking import ThinkingBudget, ThinkingTracker
from tests.unit.test_thinking_budget import committed_by_rounds, forced_next


def test_free_is_the_model_ids_before_the_first_id_a_budget_can_force():
    """Outside a section the soonest a forced id comes is after the start ids' last id and
    the whole budget: free() is exactly that many, and counts down inside the section."""
    tracker = ThinkingTracker(ThinkingBudget(2, (1,), (8,)), [5])
    assert tracker.free() == 3
    for token, left in [(1, 2), (4, 1), (4, 0)]:
        assert tracker.forced() is None
        tracker.advance(token)
        assert tracker.free() == left
    assert tracker.forced() == 8 and tracker.free() == 0


def test_start_ids_are_read_from_the_output_since_the_last_close_alone():
    """The end ids (7, 8) close a section and the next id (1) with the closing 8 before it
    reads as the start ids (8, 1): vLLM's scan starts again after the close, so no section
    opens there and the budget forces nothing."""
    budget = ThinkingBudget(3, (8, 1), (7, 8))
    output = (8, 1, 4, 7, 8, 1, 4, 4, 4, 4)
    state = committed_by_rounds([5], [output], budget, max_tokens=len(output))
    assert state.output_token_ids == list(output)
    assert all(forced_next([5], list(output[:n]), budget) is None for n in range(len(output)))


def test_repetition_detection_takes_the_largest_pattern_size_served():
    assert RepetitionDetection(MAX_PATTERN_SIZE, 0, 2).max_pattern_size == MAX_PATTERN_SIZE
    with pytest.raises(ValueError, match=f"at most {MAX_PATTERN_SIZE}"):
        RepetitionDetection(MAX_PATTERN_SIZE + 1, 0, 2)


def test_repetition_detection_refuses_a_min_count_under_two_for_patterns_of_one_id():
    with pytest.raises(ValueError, match="min_count must be >= 2"):
        RepetitionDetection(1, 1, 1)
    assert RepetitionDetection(1, 1, 2).repeats([3, 3], 2)


def test_a_pattern_is_found_past_a_failed_size_whose_next_size_also_ends_in_the_last_id():
    """aba aba aba, min_count 3: the ids 2 and 3 before the last are both a, so sizes 2 and
    3 are candidates; size 2 fails (its "ba" follows "aa") and size 3, tried next, repeats."""
    detect = RepetitionDetection(3, 0, 3)
    output = [0, 1, 0] * 3
    assert detect.repeats(output, len(output))
    assert not detect.repeats(output[:-1], len(output) - 1)
