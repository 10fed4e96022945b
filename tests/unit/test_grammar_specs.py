"""Structured outputs' specs as they compile, on the demo tokenizer: a spec that cannot be
is refused naming its field and saying why, before llguidance spends the event loop on it
(a schema past the size bound, one that expands past the symbols' bound, a grammar of blank
lines); GBNF's unicode escapes hold their characters; a repeated spec compiles once."""

import json
import re

import pytest

from speculative.grammar import GrammarError, compile_spec, lark_of
from speculative.token_masks import TokenMasks
from tests.unit.test_structured import demo_pair


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


@pytest.mark.parametrize("kind, spec, field", [
    ("json", "{not json", "json"), ("json", {"type": "nonsense"}, "json"),
    ("regex", "[0-9", "regex"), ("choice", [], "choice"), ("choice", "one", "choice"),
    ("grammar", "start: undefined_rule", "grammar"), ("json", "[" * 100000, "json"),
    ("regex", "a\ud800", "regex"), ("choice", ["\udc00"], "choice"),
    # no sentence at all, or none that ends: refused here, not failed mid-request
    ("regex", "[^\\s\\S]", "regex"), ("regex", "abc[^\\s\\S]", "regex"),
    ("grammar", 'start: "abc" B\nB: /[^\\s\\S]/', "grammar"),
    ("grammar", 'start: "abc" b\nb: "d" b', "grammar"),
    ("grammar", 'root ::= ("a"', "grammar"), ("grammar", "root ::= undefined", "grammar"),
    ("grammar", 'root ::= "a"\n' + "# a comment\n" * 2000, "grammar"),
    ("grammar", 'root ::= "a"' + ' ("b"' * 4000 + ")" * 4000, "grammar"),
    ("json", {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                              "required": ["c"]}}, "$ref": "#/$defs/n"}, "json")])
def test_specs_that_cannot_compile_name_their_field(demo, kind, spec, field):
    with pytest.raises(GrammarError) as refused:
        compile_spec(kind, spec, demo[3])
    assert refused.value.field == field


@pytest.mark.parametrize("gbnf, text, other", [
    ('root ::= "\\u00e9t\\u00E9"', "été", "ete"), ('root ::= [\\u00e0-\\u00ff]+', "àÿ", "a"),
    ('root ::= "\\U0001F600"', "😀", "x"), ('root ::= "\\u0041\\u0022\\u005c"', 'A"\\', "A"),
    ('root ::= [^\\u0000-\\u007f]', "é", "a"), ('root ::= "\\\\u0041"', "\\u0041", "A")])
def test_gbnf_unicode_escapes_hold_their_characters(demo, gbnf, text, other):
    """llama.cpp's \\uXXXX and \\UXXXXXXXX: llguidance's converter wrote \\u00e9 as \\ue9,
    which its Lark refuses (a valid grammar was a 400: "3(13): lexer error"); an escaped
    backslash before a `u` stays text."""
    tokenizer, _, _, ll = demo
    grammar = compile_spec("grammar", gbnf, ll)
    for sample, taken in ((text, True), (other, False)):
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        matcher = TokenMasks(ll, grammar)
        assert (matcher.advance(ids) == len(ids) and matcher.matcher.is_accepting()) == taken


def test_a_choice_is_its_strings_as_text_not_as_regexes(demo):
    """vLLM's guided_choice: each choice is literal text, a regex's metacharacters in it
    included ("x+1" read as a regex takes "xx1" and refuses itself)."""
    tokenizer, _, _, ll = demo
    grammar = compile_spec("choice", ["x+1", "(a)", "b.c"], ll)
    for sample, taken in (("x+1", True), ("(a)", True), ("b.c", True), ("xx1", False),
                          ("a", False), ("bzc", False)):
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        matcher = TokenMasks(ll, grammar)
        assert (matcher.advance(ids) == len(ids) and
                matcher.matcher.is_accepting()) == taken, sample


@pytest.mark.parametrize("blank", ["\n", " \n"])
def test_a_grammar_of_blank_lines_is_refused_at_once(demo, blank, monkeypatch):
    """Whether a grammar is Lark was read with llguidance's is_lark_syntax, quadratic in a
    run of blank lines and before any bound: 32k newlines held the GIL 6 s (the body's
    2 MiB, over an hour). Its own pattern (LARK_START: the blanks of one line alone) finds
    the same lines, and llguidance's is not called."""
    from llguidance import gbnf_to_lark

    from speculative.grammar import LARK_START

    texts = ["start: x", " \t start : x", "a\n  %llguidance {}", "root ::= x\n\n start:",
             "x start: y", "\n\n", "  \n\tstart", "starts: x", "%llguidancex"]
    assert [bool(LARK_START.search(t)) for t in texts] == \
        [gbnf_to_lark.is_lark_syntax(t) for t in texts]
    monkeypatch.setattr(gbnf_to_lark, "is_lark_syntax", None)  # called: a TypeError
    with pytest.raises(GrammarError, match="at most 16384 characters"):
        compile_spec("grammar", blank * 40_000 + 'root ::= "a"', demo[3])


@pytest.mark.parametrize("kind, spec, said", [
    ("regex", r"\d+(?=x)", "look-around"), ("regex", r"(a)\1", "backreferences are not"),
    ("json", {"type": "string", "pattern": "[z-a]"}, "[z-a]: invalid character class")])
def test_a_regex_that_does_not_parse_says_why(demo, kind, spec, said):
    """llguidance puts what is wrong below its first line, which alone ended at "regex
    parse error:" (a schema's pattern was not even named)."""
    with pytest.raises(GrammarError, match=re.escape(said)):
        compile_spec(kind, spec, demo[3])


def expanding_schema(depth: int, properties: int) -> dict:
    """An object whose property is `depth` levels of allOf with an anyOf of the level below:
    a kilobyte or so that llguidance multiplies into as many symbols as the levels
    allow (depth 4, 16 properties: 240k)."""
    levels = {"d0": {"type": "object", "properties": {f"x{j}": {"type": "integer"}
                                                      for j in range(properties)}}}
    for i in range(1, depth + 1):
        below = {"$ref": f"#/$defs/d{i - 1}"}
        levels[f"d{i}"] = {"allOf": [below, {"anyOf": [below, {
            "type": "object", "properties": {f"y{i}": {"type": "string"}}}]}]}
    return {"type": "object", "$defs": levels, "required": ["a"],
            "properties": {"a": {"$ref": f"#/$defs/d{depth}"}}}


@pytest.mark.parametrize("spec", [[], [""], ["yes", ""], "yes"])
def test_a_choice_that_chooses_nothing_says_what_it_takes(demo, spec):
    with pytest.raises(GrammarError, match="a non-empty list of non-empty strings"):
        compile_spec("choice", spec, demo[3])


@pytest.mark.parametrize("kind, spec", [
    ("regex", "[^\\s\\S]"), ("regex", "abc[^\\s\\S]"),
    ("grammar", 'start: "abc" B\nB: /[^\\s\\S]/')])
def test_an_empty_language_is_refused_as_empty_not_as_its_end_breaking_it(demo, kind, spec):
    """Where no text can follow, llguidance's mask allows the end token alone (here id 0,
    the lowest): the probe leaves the end tokens out, so the client reads why ("its
    language is empty"), not the matcher's NoExtensionBias after consuming the end."""
    with pytest.raises(GrammarError, match="its language is empty"):
        compile_spec(kind, spec, demo[3])


def test_a_schema_that_expands_past_the_symbols_bound_is_refused_as_it_compiles(demo):
    """1.2 KB of schema that llguidance expanded to 240k symbols took 2 s of the tokenizing
    thread and then broke the matcher (a ValueError carrying Rust's backtrace, no field):
    compiling stops at MAX_GRAMMAR_SYMBOLS and names the field and the bound."""
    schema = expanding_schema(4, 16)
    assert len(json.dumps(schema)) < 1500
    with pytest.raises(GrammarError, match="symbols") as refused:
        compile_spec("json", schema, demo[3])
    assert refused.value.field == "json"


def test_a_schema_far_past_the_size_bound_is_refused_before_llguidance_reads_it(monkeypatch):
    """llguidance reads a schema holding the GIL (a 2 MiB one: 0.5 s of the event loop),
    and the grammar it made was then refused as too long: a schema whose own text is past
    twice the bound is refused unread."""
    from types import SimpleNamespace

    from speculative import grammar

    read, real = [], grammar.llguidance().LLMatcher

    def reading(*args, **options):
        read.append(args)
        return real.grammar_from_json_schema(*args, **options)

    monkeypatch.setattr(grammar, "llguidance", lambda: SimpleNamespace(
        LLMatcher=SimpleNamespace(grammar_from_json_schema=reading)))
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(20_000)}}
    with pytest.raises(GrammarError, match="characters"):
        grammar.grammar_text("json", schema)
    assert read == []


def test_a_repeated_spec_compiles_once_and_a_failing_one_each_time(demo, monkeypatch):
    """The router compiles a spec once for the requests that repeat it (a completions
    batch's prompts share their request's: 128 prompts of a large schema compiled it 128
    times on the one tokenizing thread); a refusal is not kept, and a spec nested past what
    JSON text holds is refused uncached."""
    from speculative import grammar

    calls = []
    real = grammar.compile_spec
    monkeypatch.setattr(grammar, "compile_spec", lambda *args: calls.append(args[0]) or
                        real(*args))
    grammar.spec_compiled.cache_clear()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammars = [grammar.compile_cached("json", json.loads(json.dumps(schema)), demo[3])
                for _ in range(3)]
    assert calls == ["json"] and grammars[0] == grammars[1] == grammars[2]
    grammar.compile_cached("regex", "[0-9]+", demo[3])  # another spec: its own grammar
    assert calls == ["json", "regex"]
    for _ in range(2):
        with pytest.raises(GrammarError):
            grammar.compile_cached("regex", "(a)\\1", demo[3])
    assert calls == ["json", "regex", "regex", "regex"]
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(GrammarError, match="nested too deeply"):
        grammar.compile_cached("json", nested, demo[3])


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f"]}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<g>", "schema": {}, "end": ""}]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
     "response_format.format"),
    ({"structured_outputs": {"structural_tag": '{"structures": 1}'}},
     "structured_outputs.structural_tag")])
def test_a_structural_tag_that_cannot_be_is_refused_naming_its_field(fields, param):
    from pydantic import ValidationError

    from deployments.openai_api import CompletionRequest
    from deployments.tools import FieldError

    with pytest.raises((ValidationError, FieldError)) as refused:
        CompletionRequest.model_validate({"prompt": "x", **fields}).constraint()
    error = refused.value
    named = error.param if isinstance(error, FieldError) else \
        ".".join(map(str, error.errors()[0]["loc"]))
    assert named == param


def test_a_gbnf_grammar_takes_16384_characters_as_docs_serving_says():
    """docs/serving.md: GBNF "at most 16,384 characters"; the bound is the text's, as sent."""
    rule = 'root ::= "a"'
    assert lark_of(rule + " " * (16384 - len(rule)))
    with pytest.raises(GrammarError, match="at most 16384 characters") as refused:
        lark_of(rule + " " * (16385 - len(rule)))
    assert refused.value.field == "grammar"
