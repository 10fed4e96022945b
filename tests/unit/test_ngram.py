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
