"""The output's text read from its ids as they come (speculative.driver.Detokenizer,
text_decoder): byte-level and SentencePiece byte-fallback tokenizers, characters split over
tokens or never completed, prompts that end inside a character, decoders with and without
transformers' backend. Stops and ids: test_driver.py."""

import pytest

from speculative.driver import (
    CONTEXT_TOKENS,
    MAX_HELD_TOKENS,
    Detokenizer,
    context_window,
    text_decoder,
)
from tests.tiny import byte_fallback_tokenizer, byte_level_tokenizer
from tests.unit.test_driver import generate


def detokenized(tokenizer, prompt_ids, ids):
    detokenizer = Detokenizer(text_decoder(tokenizer), prompt_ids)
    pieces = [detokenizer.add(i) for i in ids]
    return "".join(pieces) + detokenizer.flush()


def test_byte_level_text_equals_the_decoded_ids_with_multibyte_characters():
    from specserve.demo import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    prompt = tokenizer("def f(", add_special_tokens=False)["input_ids"]
    ids = tokenizer("x): é 日本 🐍 return x\n", add_special_tokens=False)["input_ids"]
    assert len(ids) > 12  # the rare characters are split into byte tokens
    assert detokenized(tokenizer, prompt, ids) == tokenizer.decode(ids)


def test_a_decoder_that_skips_no_special_token_writes_each_out():
    """skip_special_tokens false (vLLM's): special tokens' texts are part of the text, the
    tool tags' decoder's kept ones and the others alike."""
    from specserve.demo import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "<|im_end|>"]})
    ids = tokenizer("return <tool_call>x<|im_end|>", add_special_tokens=False)["input_ids"]
    assert text_decoder(tokenizer)(ids) == "return x"
    assert text_decoder(tokenizer, keep=("<tool_call>",))(ids) == "return <tool_call>x"
    assert text_decoder(tokenizer, keep=("<tool_call>",), skip_special=False)(ids) == \
        text_decoder(tokenizer, skip_special=False)(ids) == "return <tool_call>x<|im_end|>"


def test_the_decoder_gives_transformers_text_with_or_without_its_backend():
    import random

    from specserve.demo import train_tokenizer
    from tests.tiny import rewriting_tokenizer

    direct = train_tokenizer(["def f(x):\n    return x é 日本\n"] * 20, vocab_size=300)
    assert direct.clean_up_tokenization_spaces is False  # decodes through the backend
    rewriting = rewriting_tokenizer()
    assert rewriting.clean_up_tokenization_spaces  # transformers' cleanup: its own decode
    rng = random.Random(0)
    for tokenizer in (direct, rewriting):
        decode = text_decoder(tokenizer)
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
            ids.insert(rng.randrange(len(ids)), tokenizer.eos_token_id or 0)  # a special one
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_whose_decode_rewrites_earlier_text_loses_no_text():
    from tests.tiny import rewriting_tokenizer

    tokenizer = rewriting_tokenizer()
    ids = tokenizer("it ' s a b , c ' d .", add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids)
    assert not whole.startswith(tokenizer.decode(ids[:2]))  # decode rewrites earlier text
    text = detokenized(tokenizer, [], ids)
    assert text.replace(" ", "") == whole.replace(" ", "")


def test_sentencepiece_leading_spaces_survive_across_the_prompt_boundary():
    from tests.tiny import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    prompt = tokenizer("hello", add_special_tokens=False)["input_ids"]
    ids = tokenizer("hello world again", add_special_tokens=False)["input_ids"][len(prompt):]
    assert detokenized(tokenizer, prompt, ids) == " world again"


def test_bytes_that_never_form_a_character_stream_out_and_keep_decodes_short():
    """A run of tokens whose bytes form no UTF-8 character (a model's garbage, or one forced
    by logit_bias) ends in U+FFFD at every token: held back for good, it would stream
    nothing and re-decode the whole held run at each token (quadratic, on the router's
    event loop). Held no longer than a character can take, it goes out as it comes."""
    from specserve.demo import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd" and
                tokenizer.convert_ids_to_tokens(i) == "Ģ")  # byte 0x80: a continuation
    decode, longest = text_decoder(tokenizer), [0]

    def measured(ids):
        longest[0] = max(longest[0], len(ids))
        return decode(ids)

    detokenizer = Detokenizer(measured, [50])
    pieces = [detokenizer.add(lone) for _ in range(200)]
    assert sum(map(len, pieces)) >= 190 and longest[0] <= 2 * 8 + 1
    assert "".join(pieces) + detokenizer.flush() == decode([lone] * 200)
    # a character split over byte tokens still comes whole, never as U+FFFD
    ids = tokenizer("x 🐍 日本 y", add_special_tokens=False)["input_ids"]
    detokenizer = Detokenizer(decode, [50])
    pieces = [detokenizer.add(i) for i in ids]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == "x 🐍 日本 y"


def test_a_character_after_bytes_that_never_form_one_still_comes_whole():
    """Bytes that form no character go out after MAX_HELD_TOKENS tokens, but the last tokens
    held may begin a character: read then, its U+FFFD stayed for good and the character's
    completing bytes added nothing (5 to 7 stray bytes before a 4-byte emoji lost it)."""
    from specserve.demo import train_tokenizer

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd" and
                tokenizer.convert_ids_to_tokens(i) == "Ģ")  # byte 0x80: a continuation
    decode = text_decoder(tokenizer)
    tail = tokenizer("🐍 ok", add_special_tokens=False)["input_ids"]
    for strays in range(12):
        ids = [lone] * strays + tail
        detokenizer = Detokenizer(decode, [50])
        pieces = [detokenizer.add(i) for i in ids]
        assert "".join(pieces) + detokenizer.flush() == decode(ids), strays
        assert "".join(pieces).endswith("🐍 ok"), strays


def test_a_window_that_starts_inside_a_character_spoils_no_byte_fallback_output():
    """The window's first tokens may be the last bytes of one of the prompt's characters.
    Under SentencePiece's byte fallback a run of byte tokens that is no UTF-8 decodes to a
    U+FFFD per byte, the output's bytes that continue the run included: three emoji after a
    prompt that ended in two came back as twelve U+FFFD."""
    tokenizer = byte_fallback_tokenizer(["▁Say", "▁ok"])
    say, ok = tokenizer.convert_tokens_to_ids(["▁Say", "▁ok"])
    emoji = [3 + b for b in "🐍".encode()]  # <0xF0> <0x9F> <0x90> <0x8D>
    prompt, output = [say, *emoji * 2], [*emoji * 3, ok]
    assert tokenizer.decode(output) == "🐍🐍🐍 ok"
    for k in (0, 2, 5):  # a character's bytes committed together, or a round each
        generation, deltas = generate(output, decode=text_decoder(tokenizer), k=k,
                                      prompt=tuple(prompt))
        assert generation.text == "".join(deltas) == "🐍🐍🐍 ok"


def test_a_prompt_that_ends_inside_a_character_loses_no_output_text_nor_stop():
    """A prompt of token ids may end inside a character (a cut-off output fed back to go
    on). Read into the window, the output's bytes that completed it made the window's two
    U+FFFD one character: the output's first "a" was lost, and with it a stop string there
    (found two tokens later). Its bytes read as the output's own, no character."""
    tokenizer = byte_fallback_tokenizer(["▁Say", "a", "b"])
    say, a, b = tokenizer.convert_tokens_to_ids(["▁Say", "a", "b"])
    emoji = [3 + byte for byte in "🐍".encode()]
    prompt, output = (say, *emoji[:2]), [*emoji[2:], a, b, a]
    decode = text_decoder(tokenizer)
    for k in (0, 3):
        whole, deltas = generate(output, decode=decode, k=k, prompt=prompt)
        assert whole.text == "".join(deltas) == decode(output) == "\ufffd\ufffdaba"
        stopped, deltas = generate(output, stop=("a",), decode=decode, k=k, prompt=prompt)
        assert stopped.token_ids == output[:3] and stopped.stop_reason == "a"
        assert stopped.text == "".join(deltas) == "\ufffd\ufffd"


def test_a_prompt_that_ends_in_real_replacement_characters_keeps_its_window():
    """A prompt may end in real U+FFFDs (mojibake): two are six byte-fallback tokens, trimmed
    as if they began a character, which left no window: the output's first token lost its
    leading space, and a stop string that began with it was found a token late."""
    tokenizer = byte_fallback_tokenizer(["▁Hello", "▁ok"])
    hello, ok = tokenizer.convert_tokens_to_ids(["▁Hello", "▁ok"])
    prompt, decode = (hello, *[3 + b for b in "\ufffd\ufffd".encode()]), text_decoder(tokenizer)
    for k in (0, 2):
        whole, deltas = generate([ok, ok], decode=decode, k=k, prompt=prompt)
        assert whole.text == "".join(deltas) == " ok ok"
        stopped, deltas = generate([ok, ok], stop=(" ok",), decode=decode, k=k, prompt=prompt)
        assert (stopped.token_ids, stopped.stop_reason, stopped.text) == ([ok], " ok", "")


# byte-level tokens of 日 (E6 97 A5): its first two bytes, and its last with the next's first
FIRST, SPANNING, MIDDLE, LAST = 257, 258, 1 + 0x97, 1 + 0xA5


def test_tokens_that_each_end_inside_a_character_come_whole():
    """A byte-level token may hold the end of one character and the start of the next: a
    run of them ends inside a character at every token. Read after MAX_HELD_TOKENS at a cut
    inside a character, a 日 went out as U+FFFD (and the text lost it)."""
    tokenizer = byte_level_tokenizer([b"\xe6\x97", b"\xa5\xe6", b" ok"])
    output = [FIRST, *[SPANNING, MIDDLE] * 6, LAST, 259]
    assert tokenizer.decode(output) == "日" * 7 + " ok"
    detokenizer = Detokenizer(text_decoder(tokenizer), [1 + ord("x")])
    pieces = [detokenizer.add(i) for i in output]
    assert "".join(pieces) == "日" * 7 + " ok" and "\ufffd" not in "".join(pieces)
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("max_tokens", [3, 5])
def test_a_stop_string_before_an_incomplete_character_stops_at_its_token(max_tokens):
    """The text before a character a token only begins is final: held back with it, a stop
    string there was found tokens late (the ids ran on past its token) or, when the output
    ended inside that character, never, and went out in the text flushed at the end."""
    tokenizer = byte_level_tokenizer([b"\xe6\x97", b"\xa5\xe6"])
    x = 1 + ord("x")
    output = [x, FIRST, SPANNING, MIDDLE, LAST]  # "x日日": SPANNING completes the first
    for k in (0, 3):
        generation, deltas = generate(output, stop=("日",), k=k, max_tokens=max_tokens,
                                      decode=text_decoder(tokenizer), prompt=(x,))
        assert generation.token_ids == output[:3]
        assert generation.text == "".join(deltas) == "x"
        assert (generation.finish_reason, generation.stop_reason) == ("stop", "日")


def test_bytes_that_form_no_character_go_out_at_the_held_limit():
    """Held while they may still begin a character, stray bytes go out as U+FFFDs once
    MAX_HELD_TOKENS tokens are held, all but the last few tokens' (which may begin one)."""
    detokenizer = Detokenizer(text_decoder(byte_level_tokenizer([])), [1 + ord("x")])
    pieces = [detokenizer.add(1 + 0x80) for _ in range(MAX_HELD_TOKENS)]
    assert pieces[:-1] == [""] * (MAX_HELD_TOKENS - 1) and pieces[-1].startswith("\ufffd")
    assert "".join(pieces) + detokenizer.flush() == "\ufffd" * MAX_HELD_TOKENS


def test_tokens_that_each_end_inside_a_character_are_read_once_past_the_held_limit():
    """Each token "A" + the first byte of a 3-byte character: every text ends in U+FFFD,
    so the tokens are held; past MAX_HELD_TOKENS they are read up to a cut that leaves the
    text as it is, and what of it already went out does not go out again."""
    ids = [257] * (3 * MAX_HELD_TOKENS)
    tokenizer = byte_level_tokenizer([b"A\xe6"])
    assert detokenized(tokenizer, [1 + ord("x")], ids) == "A\ufffd" * len(ids)


def test_the_window_is_the_last_context_tokens_of_a_plain_context():
    """A context of whole characters gives its last CONTEXT_TOKENS ids as the window (all of
    them when it is shorter): no fewer, so a tokenizer's decode that reads a few tokens back
    reads them."""
    def letters(ids):
        return "".join(chr(ord("a") + i) for i in ids)

    context = list(range(2 * CONTEXT_TOKENS))
    assert context_window(letters, context) == context[-CONTEXT_TOKENS:]
    assert context_window(letters, context[:3]) == context[:3]


def test_bytes_that_form_no_character_keep_only_a_characters_tokens_held():
    """At the held limit the stray bytes go out but for the last 3 tokens (one byte each
    here), which could be the first 3 bytes of a 4-byte character: no more are held back."""
    detokenizer = Detokenizer(text_decoder(byte_level_tokenizer([])), [1 + ord("x")])
    pieces = [detokenizer.add(1 + 0x80) for _ in range(MAX_HELD_TOKENS)]
    assert pieces[-1] == "\ufffd" * (MAX_HELD_TOKENS - 3)


def test_a_token_with_no_text_keeps_the_window_before_it():
    """A token whose text is empty (a special token the decode skips) is read with the next
    one: made the window alone, the next token's SentencePiece leading space was lost."""
    tokenizer = byte_fallback_tokenizer(["▁Say", "▁ok"])
    say, ok = tokenizer.convert_tokens_to_ids(["▁Say", "▁ok"])
    ids = [ok, 1, ok, 1, 1, ok]  # </s> 1: special, skipped
    assert detokenized(tokenizer, [say], ids) == " " + tokenizer.decode(ids,
                                                                        skip_special_tokens=True)


# a SentencePiece-like decode of byte tokens: the text's leading space dropped; " 日" split
# so that each token ends inside a character (no cut of a run of them keeps its text)
SPLIT_PIECES = {0: b"x", 1: b" \xe6\x97", 2: b"\xa5 \xe6\x97", 3: b"\xa5"}


def leading_space_dropped(ids):
    return b"".join(SPLIT_PIECES[i] for i in ids).decode("utf-8", "replace").removeprefix(" ")


def test_a_held_run_with_no_cut_keeps_its_window():
    """Tokens that each end inside a character, held past MAX_HELD_TOKENS with no cut that
    keeps their text, stay held after the window: read without it, the run's first token
    lost its leading space and the text went out one character short."""
    detokenizer = Detokenizer(leading_space_dropped, [0])
    ids = [1, *[2] * (2 * MAX_HELD_TOKENS), 3]
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == " 日" * (2 * MAX_HELD_TOKENS + 1)
