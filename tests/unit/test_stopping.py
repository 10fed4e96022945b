from hypothesis import given
from hypothesis import strategies as st

from speculative.stopping import TextStream, truncate_at_stop

ALPHABET = "ab\n"


def decode(ids):
    return "".join(ALPHABET[i] for i in ids)


def test_truncate_at_stop_returns_text_before_and_ids_through_the_stop():
    assert truncate_at_stop([0, 1, 2, 0], decode, ["b\n"]) == ("a", [0, 1, 2])
    assert truncate_at_stop([0, 1], decode, ["\n"]) is None


@given(st.lists(st.integers(0, 2), max_size=30), st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
       st.lists(st.integers(1, 4), min_size=1, max_size=10))
def test_streamed_deltas_concatenate_to_the_final_text(ids, stop, steps):
    stream = TextStream(decode, stop)
    pieces, end = [], 0
    for step in steps * 10:
        end = min(len(ids), end + step)
        pieces.append(stream.update(ids[:end]))
        if stream.stopped or end == len(ids):
            break
    pieces.append(stream.finish())
    whole = decode(ids[:end])
    hit = truncate_at_stop(ids[:end], decode, stop)
    assert "".join(pieces) == (hit[0] if hit else whole)
    for s in stop:
        assert s not in "".join(pieces)
