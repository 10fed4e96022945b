"""The `pythonic` tool call parser without Ray: a Python list of calls with keyword arguments
of literal values read with ast (arguments sent as JSON), everything else content; held
while streamed only as long as it may be calls, the same over every split of the output;
bounded on hostile outputs (deep nesting, long chains, past MAX_CALLS_CHARS)."""

import copy
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments import pythonic_calls
from deployments.pythonic_calls import MAX_CALLS_CHARS, CallHead, HeldPythonic, read_pythonic
from deployments.tool_parsers import KEPT_TEXTS
from engine.models import DEMO_TARGET, load_tokenizer
from speculative.driver import text_decoder
from tests.tiny import traced_peak
from tests.unit.test_tool_parsers import PARIS, PYTHONIC, named, use_of

NAMES = {"get_weather", "now", "f"}


@pytest.mark.parametrize("text, calls", [
    (PYTHONIC, [("get_weather", PARIS)]),
    ("[get_weather(city='Paris', unit='celsius'), now()]", [("get_weather", PARIS),
                                                           ("now", "{}")]),
    (" \n[ get_weather ( city = 'Zürich' ) ,\n now() ]\n",
     [("get_weather", '{"city": "Zürich"}'), ("now", "{}")]),
    ("[f(a=1, b=-2.5, c=+3, d=True, e=None, f='x', g=[1, [2]], h={'k': {'l': []}})]",
     [("f", '{"a": 1, "b": -2.5, "c": 3, "d": true, "e": null, "f": "x", "g": [1, [2]], '
            '"h": {"k": {"l": []}}}')]),
    ("[f(x=1, x=2)]", [("f", '{"x": 2}')]),  # the last, as vLLM's
    ("[f(s='a\\nb\"c', t='\\d')]", [("f", '{"s": "a\\nb\\"c", "t": "\\\\d"}')]),
    ("[f(s='\\ud800')]", [("f", '{"s": "\\ud800"}')]),  # a lone surrogate: escaped
    ("[f(n=" + "9" * 4000 + ")]", [("f", '{"n": ' + "9" * 4000 + "}")]),
    ("[now()] # done", [("now", "{}")]), ("[now(),]", [("now", "{}")]),
    ("[now()]\n[f(x=1)]", [("now", "{}")]),  # the first statement's, as vLLM's
    ("[_f9()]", [("_f9", "{}")]),  # a name vLLM's regex refuses (it opens with "_")
    ("[f(x=" + "[" * 190 + "]" * 190 + ")]",  # under the tokenizer's 200 nested brackets
     [("f", '{"x": ' + "[" * 190 + "]" * 190 + "}")]),
])
def test_pythonic_reads_a_list_of_calls_with_literal_arguments(text, calls):
    assert read_pythonic(text, NAMES | {"_f9"}) == (None, calls)


@pytest.mark.parametrize("text", [
    "[later()]", "[now(), later()]", "[]", "[now]", "[now(), 1]", "[now()] and more",
    "Sure: [now()]", "now()", "(now())", "[now()", "[now(1)]", "[f(1, x=2)]", "[f(*a)]",
    "[f(**a)]", "[f(x=(1, 2))]", "[f(x={1, 2})]", "[f(x=b'a')]", "[f(x=1j)]", "[f(x=...)]",
    "[f(x=y)]", "[f(x=1 + 1)]", "[f(x=-True)]", "[f(x=--1)]", "[f(x={1: 2})]",
    "[f(x={**a})]", "[f(x=f'{1}')]", "[f(x=1e999)]", "[f(x=-1e999)]", "[f(x=[now()])]",
    "[(now)()]", "[now.call()]", "[f(x=1\x00)]", "[" + "a" * 65 + "()]", "[now()] = 1",
    "[now()][0]", "[f(n=" + "9" * 4301 + ")]", "<|python_tag|>[now()]", "", " "])
def test_pythonic_leaves_what_is_not_calls_as_content(text):
    assert read_pythonic(text, NAMES) is None
    assert use_of("pythonic").read(text, "stop") == (text, [], "stop")


def test_pythonic_reads_through_the_tools_in_effect():
    content, calls, finish_reason = use_of("pythonic").read(PYTHONIC[:-1] + ", now()]", "stop")
    assert (content, named(calls), finish_reason) == \
        (None, [("get_weather", PARIS), ("now", "{}")], "tool_calls")
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


@pytest.mark.parametrize("text", [
    "[f(x=" + "[" * 30_000 + "]" * 30_000 + ")]",  # the tokenizer's 200 nested brackets
    "[f(x=" + "-" * 60_000 + "1)]",  # the parser's stack: a MemoryError
    "[f(x=1" + "+1" * 30_000 + ")]",  # ast's recursion limit
    "[f(x=" + "not " * 15_000 + "1)]", "[f(x=a" + ".a" * 30_000 + ")]",
    "[f(x=" + "{'a': " * 150 + "(1, 2)" + "}" * 150 + ")]",  # a tuple deep inside
])
def test_a_hostile_output_is_content_at_bounded_cost(text):
    start = time.perf_counter()
    assert read_pythonic(text, NAMES) is None
    assert time.perf_counter() - start < 2.0  # about 0.05 s each here


def test_an_output_past_max_calls_chars_is_content_without_parsing(monkeypatch):
    """ast's work grows with the output (about 2 us and 0.5 KB a character at worst): one
    past the limit is not parsed, and a stream gives it up once it passes the limit."""
    at_limit = "[f(x='" + "a" * (MAX_CALLS_CHARS - 10) + "')]"
    assert len(at_limit) == MAX_CALLS_CHARS - 1 and read_pythonic(at_limit, NAMES)
    parsed = []
    monkeypatch.setattr(pythonic_calls, "ast", SimpleNamespace(parse=parsed.append))
    past = "[" + "now()," * (MAX_CALLS_CHARS // 6 + 1) + "]"
    assert len(past) > MAX_CALLS_CHARS and read_pythonic(past, NAMES) is None and not parsed
    held = HeldPythonic()
    sent = [held.feed(past[at:at + 100]) for at in range(0, len(past), 100)]
    held_deltas = MAX_CALLS_CHARS // 100  # given up with the delta that passes the limit
    assert "".join(sent) == past and sent[:held_deltas] == [""] * held_deltas
    assert held.rest(past) == ""


@pytest.mark.parametrize("text, opens", [
    ("[now(", True), (" \n[\n now \t(", True), ("[_x9(", True), ("[" + "a" * 64 + "(", True),
    ("[" + "a" * 65, False), ("[9(", False), ("[now)", False), ("[now.", False), ("x", False),
    ("[[", False), ("((", False), ("", None), ("  [ ", None), ("[now", None), ("[now ", None)])
def test_the_head_of_a_list_of_calls_is_read_the_same_over_any_split(text, opens):
    assert CallHead().feed(text) is opens
    for cut in range(len(text) + 1):
        head = CallHead()
        first = head.feed(text[:cut])
        assert head.feed(text[cut:]) is opens and first in (None, opens)
    one_by_one = CallHead()
    assert [one_by_one.feed(c) for c in text][-1:] == ([opens] if text else [])


PIECES = ["[", "]", "(", ")", "now", "f", "9", "_", ",", " ", "\n", "x=", "=", "-", "'a'", "'",
          "[now()]", "f(x=1)", "get_weather"]
# a list of calls (offered or not) after whitespace, then maybe more; or pieces of one
OUTPUTS = st.tuples(
    st.sampled_from(["", " ", "\n"]),
    st.lists(st.sampled_from(["now()", "f(x=1)", "f(x='a', y=[-1, {'k': None}])", "later()",
                              "get_weather(city='Paris')"]), min_size=1, max_size=3),
    st.lists(st.sampled_from(PIECES), max_size=2),
).map(lambda t: t[0] + "[" + ", ".join(t[1]) + "]" + "".join(t[2])) | \
    st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(OUTPUTS, st.lists(st.integers(1, 7), min_size=1))
def test_every_split_of_a_pythonic_output_holds_only_what_may_be_calls(text, cuts):
    """Whatever the output and its deltas: what a stream sends, then its rest, is the whole
    answer's content (nothing of an output read as calls), and it holds back only an output
    whose head may still open a list of calls."""
    read = read_pythonic(text, NAMES)
    content = text if read is None else None
    held, sent, at = HeldPythonic(), [], 0
    for cut in cuts * len(text):
        if at >= len(text):
            break
        sent.append(held.feed(text[at:at + cut]))
        at += cut
        if CallHead().feed(text[:at]) is False:  # known not to be calls: all of it sent
            assert "".join(sent) == text[:at]
    assert "".join(sent) + held.rest(content) == (content or "")
    assert read is None or not "".join(sent)


def test_a_held_pythonic_output_costs_each_delta_its_own_length():
    """Held whitespace before the list, and a held list of calls: a feed after many deltas
    makes no copy of what is held (counted in bytes allocated); given up past the limit,
    the held text is joined once."""
    for head, more in [("\n", "\n"), ("[now(x='", "abcd")]:
        held = HeldPythonic()
        assert held.feed(head) == "" and all(held.feed(more) == "" for _ in range(10_000))
        last, peak = traced_peak(lambda: held.feed(more))
        assert last == "" and peak < 10_000
        rest = "x" * MAX_CALLS_CHARS
        assert held.feed(rest) == head + more * 10_001 + rest and held.feed("y") == "y"


def test_special_tokens_around_the_list_are_skipped_from_its_text():
    """Llama's `<|python_tag|>` and Llama 4's `<|python_start|>`/`<|python_end|>` are
    special tokens: with tools in effect under `pythonic`, which reads none, they are skipped
    from the output's text (Hermes' tags kept, for forced calls), and the list is read."""
    special = copy.deepcopy(load_tokenizer(DEMO_TARGET))
    special.add_special_tokens({"additional_special_tokens": [
        "<|python_tag|>", "<|python_start|>", "<|python_end|>"]})
    decode = text_decoder(special, keep=KEPT_TEXTS["pythonic"])
    for text in ["<|python_tag|>" + PYTHONIC, "<|python_start|>" + PYTHONIC + "<|python_end|>"]:
        decoded = decode(special(text, add_special_tokens=False)["input_ids"])
        assert decoded == PYTHONIC
        assert named(use_of("pythonic").read_calls(decoded)[1]) == [("get_weather", PARIS)]
