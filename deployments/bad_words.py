"""vLLM's bad_words read into token id sequences, as vLLM's SamplingParams tokenizes them
(update_from_tokenizer): each word with its leading whitespace stripped, and again after a
space (a word inside the text, not at its start), that second form kept only where it is
another word's tokens: as many, its first one different. A special token's text in a word
is read as that token, as vLLM's tokenizer reads it (`"<|endoftext|>"` bans the end token).
The pools then mask each sequence's last token where the output ends with its other tokens
(speculative.shaping.ban_words)."""

from deployments.ingress import BadRequest
from speculative.sampling import MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS


def bad_words_ids(tokenizer, words: list[str], vocab_size: int
                  ) -> tuple[tuple[int, ...], ...]:
    """The words' token id sequences; BadRequest (param bad_words) for a word that is empty
    once tokenized or has ids outside the vocabulary, and for more than MAX_BAD_WORDS
    sequences or MAX_BAD_WORDS_TOKENS ids in all."""
    sequences: list[tuple[int, ...]] = []
    for index, word in enumerate(words):
        plain = encoded(tokenizer, word.lstrip())
        if not plain:
            raise BadRequest(f"bad_words[{index}] must tokenize to at least one token",
                             param="bad_words")
        sequences.append(plain)
        spaced = encoded(tokenizer, " " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS or sum(map(len, sequences)) > MAX_BAD_WORDS_TOKENS:
        raise BadRequest(f"bad_words make {len(sequences)} token sequences of "
                         f"{sum(map(len, sequences))} ids; the limits are {MAX_BAD_WORDS} "
                         f"and {MAX_BAD_WORDS_TOKENS}", param="bad_words")
    if outside := sorted({t for ids in sequences for t in ids if not 0 <= t < vocab_size}):
        raise BadRequest(f"bad_words tokenize to ids outside the vocabulary of {vocab_size}: "
                         f"{outside[:5]}", param="bad_words")
    return tuple(sequences)


def encoded(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()
