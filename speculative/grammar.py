"""Structured outputs: a grammar the output must follow, through llguidance.

The law of a constrained request is the target's distribution masked to the tokens the
grammar allows after the output so far, renormalised (greedy: the argmax among them), as in
vLLM. Under speculation every party masks by the same rule: the drafter masks q along its
own draft, the verifier masks p at each drafted position given the tokens drafted before
it, and a router-side drafter drops proposals the grammar forbids. Each keeps a matcher per
request that follows the committed output and rolls back whatever a round did not commit,
so a rebuild, a fallback or a pre-draft only moves it to another prefix
(speculative.token_masks).

Grammars travel as llguidance's own grammar text (what `LLMatcher.grammar_from_*`
returns); `compile_spec` builds it from the API's fields and says which field is wrong.
"""

import functools
import json
import re
from dataclasses import dataclass, field

import numpy as np

from speculative.token_masks import compiled, llguidance

MAX_GRAMMAR_CHARS = 64 * 1024
# llguidance's symbols in a grammar (its default bound is 500,000): what a compile costs
# grows with them, and a schema's allOf and anyOf multiply them, so that a 1.2 KB schema
# expanded to 240k and took 2 s to compile (then broke the matcher, whose bound is 65,525);
# 32k compile within 0.4 s, a 1 MiB prompt's tokenizing time (a 900-property object has 7k)
MAX_GRAMMAR_SYMBOLS = 32 * 1024
# a GBNF grammar's characters: converted to Lark in Python on the router's tokenizing
# thread, in a time that grows with the square of its rules (16k in 800 rules: 0.27 s)
MAX_GBNF_CHARS = 16 * 1024
# llguidance's is_lark_syntax, whose leading `\s*` crosses lines: quadratic in a run of
# blank lines, before any bound (32k newlines held the GIL 6 s, a body's million about an
# hour and a half); here the blanks before a line's text alone, which finds the same lines
LARK_START = re.compile(r"(?m)^[^\S\n]*(%llguidance\b|start\s*:)")
# GBNF's \uXXXX and \UXXXXXXXX (llama.cpp's), or any other escape (read past, kept): the
# converter writes \u00e9 as \ue9, which llguidance's Lark refuses (a "lexer error")
UNICODE_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)
# JSON laid out on one line with single spaces: with whitespace left free (llguidance's
# default), a small model spends its max_tokens on newlines inside the object; a schema's own
# "x-guidance" options override this
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot compile; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def grammar_text(kind: str, spec) -> str:
    """llguidance's grammar for a json schema (dict or text), a regex, a list of choices or a
    Lark grammar; raises GrammarError(kind) for a spec of the wrong shape."""
    matcher = llguidance().LLMatcher
    try:
        if kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            # llguidance reads a schema holding the GIL (a 2 MiB one: 0.5 s of the event
            # loop, then refused as too long): one whose own text is far past the bound is
            # refused first (its grammar holds that text)
            if len(json.dumps(schema, ensure_ascii=False)) > 2 * MAX_GRAMMAR_CHARS:
                raise GrammarError(kind, f"compiles to more than {MAX_GRAMMAR_CHARS} characters")
            return matcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if kind == "regex" and isinstance(spec, str):
            return matcher.grammar_from_regex(spec)
        if kind == "choice" and isinstance(spec, list) and spec and \
                all(isinstance(c, str) and c for c in spec):
            return matcher.grammar_from_regex("|".join(re.escape(c) for c in spec))
        if kind == "grammar" and isinstance(spec, str):
            return matcher.grammar_from_lark(lark_of(spec))
        if kind == "structural_tag" and isinstance(spec, dict):
            return matcher.grammar_from_lark(tagged_lark(spec))
    except GrammarError:
        raise
    except UnicodeError:  # a lone surrogate, which no grammar can hold
        raise GrammarError(kind, "contains text that is not valid Unicode (a lone "
                                 "surrogate?)") from None
    except (ValueError, TypeError, RecursionError) as error:
        what = "nested too deeply" if isinstance(error, RecursionError) else error
        raise GrammarError(kind, f"not a JSON schema: {what}") from None
    if kind == "choice":  # an empty list, or an empty string among them, chooses nothing
        raise GrammarError(kind, "takes a non-empty list of non-empty strings")
    raise GrammarError(kind, "has the wrong type")


def lark_of(grammar: str) -> str:
    """A grammar in llguidance's Lark dialect: a GBNF one (llama.cpp's, as vLLM's default
    backend, xgrammar, takes it: `root ::= ...`) converted by llguidance's own converter,
    a Lark one as it is; GrammarError for GBNF that does not convert."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if LARK_START.search(grammar):  # a `start:` rule (or llguidance's options)
        return grammar
    if len(grammar) > MAX_GBNF_CHARS:
        raise GrammarError("grammar", f"a GBNF grammar takes at most {MAX_GBNF_CHARS} "
                                      "characters")
    try:
        return gbnf_to_lark(UNICODE_ESCAPE.sub(unescaped, grammar))
    except RecursionError:
        raise GrammarError("grammar", "nested too deeply") from None
    except Exception as error:  # the converter's GbnfToLarkError, or its parser's own
        raise GrammarError("grammar", f"neither Lark (it has no `start:` rule) nor GBNF: "
                                      f"{error}") from None


def unescaped(escape: re.Match) -> str:
    """A GBNF escape as the converter passes it on: a code point past ASCII as itself (no
    syntax in a literal or a class), an ASCII one as a \\x escape; any other as it is."""
    digits = escape.group(1) or escape.group(2)
    point = None if digits is None else int(digits, 16)
    if point is None or point > 0x10FFFF:  # (past Unicode: the converter's error)
        return escape.group()
    return f"\\x{point:02x}" if point < 0x80 else chr(point)


def tagged_lark(tag: dict) -> str:
    """A structural tag's grammar ({"structures": [{begin, schema, end}], "triggers": [...]},
    as vLLM's guidance backend builds it): any text, in which a trigger starts the structure
    whose begin it opens, its schema's JSON, then its end."""
    module = llguidance()
    try:
        tags = [module.StructTag(trigger=next(t for t in tag["triggers"]
                                              if s["begin"].startswith(t)),
                                 begin=s["begin"], grammar=s["schema"], end=s["end"])
                for s in tag["structures"]]
        return module.StructTag.to_grammar(tags)
    except (KeyError, TypeError, StopIteration, AssertionError) as error:
        raise GrammarError("structural_tag", f"not a structural tag: {error!r}") from None


def compile_spec(kind: str, spec, tokenizer) -> str:
    """The checked grammar text; GrammarError(kind) when it cannot compile for `tokenizer`
    (an llguidance LLTokenizer)."""
    text = grammar_text(kind, spec)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(kind, f"compiles to more than {MAX_GRAMMAR_CHARS} characters")
    limits = llguidance().LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS)
    problem = llguidance().LLMatcher.validate_grammar(text, tokenizer, limits=limits)
    if not problem and tokenizer is not None:
        try:
            problem = dead_end(tokenizer, text)
        except ValueError as error:  # the matcher refused what validation passed
            problem = str(error)
    if problem:
        raise GrammarError(kind, reason(problem))
    return text


def reason(problem: str) -> str:
    """llguidance's reason on one line: its first, which for a regex that does not parse
    ends at "regex parse error:" (its lines below say what is wrong: a look-around, a
    backreference), so then with the regex and that line."""
    lines = [line.strip() for line in problem.strip().splitlines()]
    said = next((line for line in lines if line.startswith("error: ")), None)
    if not lines[0].endswith(":") or said is None or len(lines) < 2:
        return lines[0]
    return f"{lines[0]} {lines[1]}: {said.removeprefix('error: ')}"


PROBE_STEPS = 8


@functools.lru_cache(maxsize=64)
def dead_end(tokenizer, grammar: str) -> str | None:
    """Why the grammar cannot be followed from its start, or None: it allows nothing but the
    end before it is complete (an empty language: `[^\\s\\S]`), or a token its mask allows
    breaks the matcher (a rule that must recurse forever: llguidance runs out of parser
    items). Probed along the lowest allowed token for PROBE_STEPS tokens, so a dead end
    deeper in the grammar still ends its requests with an error, not a 400 here."""
    matcher = compiled(tokenizer, grammar).deep_copy()
    ends = list(tokenizer.eos_tokens or [tokenizer.eos_token])
    for _ in range(PROBE_STEPS):
        if matcher.is_accepting():
            return None
        allowed = np.frombuffer(matcher.compute_logit_bias(), np.uint8)[:tokenizer.vocab_size]
        allowed = allowed.copy()
        allowed[[end for end in ends if end < len(allowed)]] = 0
        lowest = np.flatnonzero(allowed)[:1].tolist()
        if not lowest:
            return "no text follows it (its language is empty)"
        if matcher.try_consume_tokens(lowest) != 1 or matcher.is_error():
            return f"it cannot be followed: {matcher.get_error() or 'a dead end'}"
    return None


def ll_tokenizer(hf_tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face tokenizer, over the model's vocabulary (ids the
    tokenizer lacks are never allowed)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def grammar_tokenizer_at(path: str, vocab_size: int):
    """ll_tokenizer of the checkpoint at path, or None when it has none llguidance reads
    (its pool then refuses grammars)."""
    from engine.models import load_tokenizer

    try:
        return grammar_tokenizer_or_none(load_tokenizer(path), vocab_size)
    except (OSError, ValueError):
        return None


def grammar_tokenizer_or_none(hf_tokenizer, vocab_size: int):
    """ll_tokenizer, or None for a tokenizer llguidance cannot read (a slow one, or a decoder
    it does not know, such as WordPiece's)."""
    try:
        return ll_tokenizer(hf_tokenizer, vocab_size)
    except ValueError:
        return None


@dataclass(frozen=True)
class Constraint:
    kind: str
    text: str  # the spec as JSON text: what the cache compares
    spec: object = field(compare=False, hash=False)


def compile_cached(kind: str, spec, tokenizer) -> str:
    """compile_spec, kept for the requests that repeat a spec: a completions batch's prompts
    share their request's (128 prompts of a 900-property schema compiled it 128 times, 3-4 s
    of the tokenizing thread that every request waits on), and clients send one schema with
    every call. A spec that fails is compiled again; one nested past what JSON text holds,
    uncached (compile_spec refuses it)."""
    try:
        text = json.dumps(spec)
    except (TypeError, ValueError, RecursionError):
        return compile_spec(kind, spec, tokenizer)
    return spec_compiled(Constraint(kind, text, spec), tokenizer)


@functools.lru_cache(maxsize=64)
def spec_compiled(constraint: Constraint, tokenizer) -> str:
    return compile_spec(constraint.kind, constraint.spec, tokenizer)
