"""Prompt lookup (drafter.ngram): the byte search over a request's committed ids against the
plain list scan, `lookup`, which reads as the definition."""

import random

from drafter.ngram import TokenBytes, lookup


def drawer(rng: random.Random, vocabs: list[int], spread: bool):
    """A draw of one id: from a small vocabulary (many matches, of every n), or, spread,
    among ids whose bytes straddle token boundaries (256, 65536, ...)."""
    if spread:
        return lambda: rng.choice([0, 1, 255, 256, 65_535, 65_536, 1 << 24])
    vocab = rng.choice(vocabs)
    return lambda: rng.randrange(vocab)


def calls(rng: random.Random, draw, most_new: int):
    """Six seeded lookups on one context grown call by call as a session's is: (committed,
    assumed, k, min_ngram, max_ngram) each."""
    committed = []
    for _ in range(6):
        committed += [draw() for _ in range(rng.randint(1, most_new))]
        assumed = [draw() for _ in range(rng.randint(0, 3))]
        k, low = rng.randint(1, 8), rng.randint(1, 3)
        yield committed, assumed, k, low, rng.randint(low, 5)


def test_the_byte_search_proposes_what_the_list_scan_does():
    """Seeded contexts over small vocabularies and ids whose bytes straddle token boundaries
    (drawer), grown call by call as a session's are."""
    rng = random.Random(5)
    for case in range(400):
        draw, tokens = drawer(rng, [2, 3, 5, 50, 70_000], case % 3 == 0), TokenBytes()
        for committed, assumed, k, low, high in calls(rng, draw, 12):
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
