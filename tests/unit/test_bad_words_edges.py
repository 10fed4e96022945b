"""Edges of bad_words as the router reads them (deployments.bad_words), each at its exact
bound: MAX_BAD_WORDS sequences and MAX_BAD_WORDS_TOKENS ids are taken and one more is a 400,
and the vocabulary's last id is taken and the next refused. A character tokenizer stands in
for a real one: each character a token, a space read into the next one (GPT-2's "Ġ"), so
every word is two sequences of as many ids, as vLLM keeps them."""

import re

import pytest

from deployments.bad_words import bad_words_ids
from deployments.ingress import BadRequest
from speculative.sampling import MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS

SPACED = 1000  # a space-led character's id: its own + SPACED


def characters(text: str, add_special_tokens: bool) -> dict:
    return {"input_ids": [ord(piece[-1]) + SPACED * (len(piece) == 2)
                          for piece in re.findall(r" ?\S", text)]}


def test_the_sequences_bound_is_taken_and_one_word_more_is_refused():
    words = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(MAX_BAD_WORDS // 2)]
    assert len(bad_words_ids(characters, words, 2 * SPACED)) == MAX_BAD_WORDS
    with pytest.raises(BadRequest, match=f"make {MAX_BAD_WORDS + 2} token sequences") as no:
        bad_words_ids(characters, [*words, "z" * 9], 2 * SPACED)
    assert no.value.param == "bad_words"


def test_the_ids_bound_is_taken_and_one_id_more_is_refused():
    length = MAX_BAD_WORDS_TOKENS // 2 // 8  # 8 words, each two sequences of `length` ids
    words = ["x" * length] * 8
    assert sum(map(len, bad_words_ids(characters, words, 2 * SPACED))) == MAX_BAD_WORDS_TOKENS
    with pytest.raises(BadRequest, match=f"of {MAX_BAD_WORDS_TOKENS + 2} ids"):
        bad_words_ids(characters, [*words[1:], "x" * (length + 1)], 2 * SPACED)


def test_the_vocabularys_last_id_is_taken_and_the_next_is_refused():
    last = SPACED + ord("z")  # " z": the larger of "z"'s two ids
    assert bad_words_ids(characters, ["z"], last + 1) == ((ord("z"),), (last,))
    with pytest.raises(BadRequest, match=rf"vocabulary of {last}: \[{last}\]"):
        bad_words_ids(characters, ["z"], last)
