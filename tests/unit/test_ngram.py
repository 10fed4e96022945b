"""Prompt lookup (drafter.ngram): the byte search over a request's committed ids against the
plain list scan, `lookup`, which reads as the definition."""

import random

from drafter.ngram import TokenBytes, lookup


def test_the_byte_search_proposes_what_the_list_scan_does():
    """Seeded contexts over small vocabularies (many matches, of every n) and ids whose bytes
    straddle token boundaries (256, 65536, ...), grown call by call as a session's are."""
    rng = random.Random(5)
    for case in range(400):
        vocab = rng.choice([2, 3, 5, 50, 70_000])
        spread = [0, 1, 255, 256, 65_535, 65_536, 1 << 24] if case % 3 == 0 else None
        draw = (lambda: rng.choice(spread)) if spread else (lambda: rng.randrange(vocab))
        tokens, committed = TokenBytes(), []
        for _ in range(6):
            committed += [draw() for _ in range(rng.randint(1, 12))]
            assumed = [draw() for _ in range(rng.randint(0, 3))]
            k, low = rng.randint(1, 8), rng.randint(1, 3)
            high = rng.randint(low, 5)
            context = committed + assumed
            got = tokens.extended(committed).lookup(assumed, k, low, high, context)
            assert got == lookup(context, k, low, high), (context, k, low, high)
            assert len(tokens.data) == 4 * len(committed)  # the assumed ids taken off again


def test_a_match_across_token_boundaries_is_no_match():
    """256 then 0 hold the bytes of the id 1 one byte in: the scan finds no earlier 1."""
    context = [256, 0, 7, 1]
    assert lookup(context, 3, 1, 1) == []
    assert TokenBytes().extended(context).lookup([], 3, 1, 1, context) == []


def test_a_match_that_reaches_the_end_repeats_up_to_k():
    """A loop's latest match is d tokens back, so what followed it runs into the context's
    end after d tokens: the proposal repeats them up to K (it proposed d, one for a run of a
    single token), in the reference and the byte search alike."""
    for context, k, proposed in (([5] * 20, 6, [5] * 6),
                                 ([9, 1, 2, 3] * 4, 7, [9, 1, 2, 3, 9, 1, 2]),
                                 ([1, 2, 3, 4, 2, 3], 4, [4, 2, 3, 4]),  # vLLM's example
                                 ([1, 2, 3, 9, 1, 2], 2, [3, 9])):  # K within: as it was
        assert lookup(context, k, 1, 4) == proposed
        assert TokenBytes().extended(context).lookup([], k, 1, 4, context) == proposed
