"""The request driver: stop ids, stop strings, incremental text, exact output ids."""

import asyncio
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative import driver
from speculative.driver import Detokenizer, Generation, GrowingText, text_decoder
from speculative.fixed_k import FixedK
from speculative.state import Request
from speculative.sampling import SamplingParams
from tests.tiny import (
    Agreeing,
    Scripted,
    byte_fallback_tokenizer,
    byte_level_tokenizer,
    traced_peak,
)

ALPHABET = "ab\n"
PROMPT = (0,)


def decode(ids):
    return "".join(ALPHABET[i] for i in ids)


def generate(output, stop=(), stop_ids=(), k=3, max_tokens=None, miss=3, reported=None,
             min_tokens=0, decode=decode, prompt=PROMPT, include=False):
    params = SamplingParams(temperature=0, max_tokens=max_tokens or len(output), stop=stop,
                            min_tokens=min_tokens, include_stop_str_in_output=include)
    generation = Generation(Request("r", prompt, params, tuple(stop_ids)), decode, reported)
    engine = Scripted(output, miss, len(prompt))

    async def collect():
        return [d async for d in generation.stream(engine, engine, FixedK(k))]

    return generation, asyncio.run(collect())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
       st.integers(0, 5), st.integers(2, 4))
def test_stop_strings_cut_text_and_ids_where_the_stop_completes(output, stop, k, miss):
    generation, deltas = generate(output, tuple(stop), k=k, miss=miss)
    ids, text = generation.token_ids, generation.text
    assert "".join(deltas) == text  # streamed == non-streamed
    # the first stop string to complete, token by token, ends the request
    end = next((n for n in range(1, len(output) + 1)
                if any(s in decode(output[:n]) for s in stop)), None)
    if end is None:
        assert ids == output and text == decode(output)
        assert generation.finish_reason == "length" and generation.stop_reason is None
        return
    assert ids == output[:end]
    cut = min(i for i in (decode(ids).find(s) for s in stop) if i >= 0)
    assert text == decode(ids)[:cut]
    assert generation.finish_reason == "stop" and generation.stop_reason in stop
    assert decode(ids)[cut:].startswith(generation.stop_reason)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(ALPHABET, max_size=5), st.integers(0, 12)), max_size=12))
def test_a_text_kept_in_pieces_reads_as_one_string(steps):
    """GrowingText with a tail of 2 characters (so most of it is in pieces): appended,
    read from any point and cut anywhere, it is the string grown by +=."""
    with mock.patch.object(driver, "TAIL_CHARS", 2):
        grown, text = GrowingText(), ""
        for delta, at in steps:
            grown.append(delta)
            text += delta
            assert (len(grown), grown.since(at), str(grown)) == (len(text), text[at:], text)
            if at % 3 == 0:
                grown.cut(at)
                text = text[:at]
        assert str(grown) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
       st.integers(0, 5), st.integers(2, 8), st.booleans())
def test_a_text_mostly_in_pieces_streams_and_stops_as_one_string(output, stop, k, miss,
                                                                 include):
    """The driver over a GrowingText whose tail is 2 characters (a round's text reaches
    into its pieces): the same text, deltas, ids and stop as over one string."""
    whole = generate(output, tuple(stop), k=k, miss=miss, include=include)
    with mock.patch.object(driver, "TAIL_CHARS", 2):
        pieces = generate(output, tuple(stop), k=k, miss=miss, include=include)
    assert [(g.text, deltas, g.token_ids, g.stop_reason) for g, deltas in (whole, pieces)] \
        == [(whole[0].text, whole[1], whole[0].token_ids, whole[0].stop_reason)] * 2


def test_each_token_costs_the_output_text_its_own_length():
    """The text grown by += was copied whole at each token: quadratic (1.3 s of the event
    loop over a 128k-token output). Counted in bytes allocated, a token after 200k characters
    of text, with the longest stop strings searched, copies none of them."""
    def long_decode(ids):
        return "".join("words in a line, fifty characters of text each ok." for _ in ids)

    params = SamplingParams(temperature=0, max_tokens=10_000, stop=("z" * 256, "#"))
    generation = Generation(Request("r", PROMPT, params), long_decode)

    def one_token():
        generation._take(generation.state.commit((1,)))
        return generation._ready()

    text = "".join(one_token() for _ in range(4_000))
    last, peak = traced_peak(one_token)
    assert len(text) > 80_000 and peak < 20_000
    assert text + last == generation.text == long_decode([1] * 4_001)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=20),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 6), st.integers(0, 4))
def test_a_stop_string_counts_from_min_tokens_on(output, stop, min_tokens, k):
    """As vLLM (V1's detokenizer): no stop string is looked for until the output holds more
    than min_tokens tokens (min_tokens of them come before the one that stops it, as before a
    stop token), and then each is looked for where it ends in a token's new text, so one
    seen earlier does not stop the output later (a token here is one character)."""
    min_tokens = min(min_tokens, len(output))
    generation, deltas = generate(output, tuple(stop), k=k, min_tokens=min_tokens)
    end = next((n for n in range(min_tokens + 1, len(output) + 1)
                if any(decode(output[:n]).endswith(s) for s in stop)), None)
    assert generation.token_ids == output[:end or len(output)]
    assert "".join(deltas) == generation.text
    if end is not None:
        assert generation.text == decode(output[:end])[:end - len(generation.stop_reason)]


def test_a_stop_token_ends_the_output_and_stays_in_its_ids_not_its_text():
    output = [0, 1, 2, 1, 0, 0, 2, 2]
    generation, deltas = generate(output, stop_ids=(2,), k=4)
    assert generation.token_ids == [0, 1, 2]
    assert (generation.finish_reason, generation.stop_reason) == ("stop", 2)
    assert generation.text == "".join(deltas) == "ab"  # as vLLM: not the stop token's "\n"


def test_an_end_token_the_request_did_not_ask_for_is_no_stop_reason():
    """As vLLM: stop_reason names a stop string or one of the request's own stop ids; the
    model's end tokens (stop ids not reported) end the output with none."""
    output = [0, 1, 2, 1, 0, 0, 2, 2]
    assert generate(output, stop_ids=(2,), k=4, reported=())[0].stop_reason is None
    assert generate(output, stop_ids=(2,), k=4, reported=(2,))[0].stop_reason == 2


def test_the_earlier_of_a_stop_string_and_a_stop_token_wins():
    output = [0, 1, 0, 2, 1]  # "aba\nb": the stop string "ba" completes before token 2
    generation, _ = generate(output, stop=("ba",), stop_ids=(2,), k=4)
    assert generation.token_ids == [0, 1, 0] and generation.stop_reason == "ba"
    assert generation.text == "a"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 5))
def test_an_included_stop_string_ends_the_text(output, stop, k):
    """vLLM's include_stop_str_in_output: the same tokens, the text cut after the stop string
    instead of before it, streamed as it comes (nothing held back: nothing will be cut)."""
    cut, _ = generate(output, tuple(stop), k=k)
    kept, deltas = generate(output, tuple(stop), k=k, include=True)
    assert kept.token_ids == cut.token_ids and "".join(deltas) == kept.text
    assert kept.text == cut.text + (kept.stop_reason or "")
    assert kept.stop_reason == cut.stop_reason


def test_an_included_stop_string_holds_nothing_back():
    """A tail that may grow into the stop string goes out at once (it is not cut): a token a
    round, a delta a round ("b" of "bb" held, without it)."""
    held = generate([0, 1, 0, 1, 1, 0], stop=("bb",), k=0)[1]
    sent = generate([0, 1, 0, 1, 1, 0], stop=("bb",), k=0, include=True)[1]
    assert (held, sent) == (["a", "ba"], ["a", "b", "a", "b", "b"])


def test_an_included_stop_token_keeps_its_text():
    generation, deltas = generate([0, 1, 2, 1, 0], stop_ids=(2,), k=4, include=True)
    assert generation.token_ids == [0, 1, 2] and generation.stop_reason == 2
    assert generation.text == "".join(deltas) == "ab\n"


def test_max_tokens_is_length():
    generation, _ = generate([0, 1, 0, 1, 0, 1], max_tokens=4, k=5)
    assert generation.token_ids == [0, 1, 0, 1] and generation.finish_reason == "length"


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


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_routers_own_work_after_the_verify_is_its_phase_not_transport(
        monkeypatch, pipelined):
    """spec_decode_round_seconds{phase}: rejection sampling and the commit are the router's;
    only the wait for a pre-draft after the verify is the drafter's. A clock that moves only
    while accept runs (10 ms a round) must book it all as phase router."""
    import speculative.loop as loop
    import speculative.meter as meter

    now = [0.0]
    monkeypatch.setattr(meter.time, "perf_counter", lambda: now[0])
    real_accept = loop.accept

    def accept(*args, **kwargs):
        now[0] += 0.010
        return real_accept(*args, **kwargs)

    monkeypatch.setattr(loop, "accept", accept)
    request = Request("r", (2, 3), SamplingParams(temperature=0.0, max_tokens=40))
    generation = Generation(request)
    asyncio.run(generation.run(Agreeing(), Agreeing(), FixedK(3), pipelined))
    phases = generation.stats.ms_per_round()
    assert phases["router"] == phases["total"] == 10.0
    assert phases["transport"] == phases["draft"] == phases["verify"] == 0.0


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
