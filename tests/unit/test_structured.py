"""Structured outputs exact under speculation, on the demo pair and its tokenizer.

Greedy output under a JSON schema, a regex, a choice, a Lark grammar and any JSON object
equals a reference written here (the target alone, the whole sequence forwarded each step,
the argmax among the tokens a fresh llguidance matcher allows), for K = 0, fixed K, auto K,
pipelined drafting and the n-gram drafter; and it follows its constraint.
"""

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.driver import text_decoder
from speculative.grammar import compile_spec, ll_tokenizer
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.token_masks import TokenMasks
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ProposeCall
from tests.tiny import run
from verifier.engine import ModelVerifier

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}
SPECS = {
    "json": ("json", SCHEMA),
    "json_object": ("json", {"type": "object"}),
    "regex": ("regex", r"def [a-z_]{1,12}\(self(, [a-z]{1,8}){0,2}\):"),
    "choice": ("choice", ["import os", "import sys", "from typing import List"]),
    "grammar": ("grammar", 'start: "x = " SUM\nSUM: /[0-9]{1,3}( \\+ [0-9]{1,3}){0,3}/'),
    # llama.cpp's GBNF (vLLM's default backend takes it), converted to Lark by llguidance
    "gbnf": ("grammar", 'root ::= "x = " num (" + " num){0,3}\nnum ::= [0-9]{1,3}'),
}
PROMPT = "# settings\n"
MAX_TOKENS = 40


def demo_pair() -> tuple:
    """(the demo target's tokenizer, the target, the draft, the target's llguidance tokenizer)."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    target = load_causal_lm(DEMO_TARGET)
    vocab = target.config.vocab_size
    return tokenizer, target, load_causal_lm(DEMO_DRAFT), ll_tokenizer(tokenizer, vocab)


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def reference(target, ll, grammar: str, prompt: list[int], eos: int) -> list[int]:
    """Masked greedy decoding written out: a fresh matcher, a full forward per token."""
    matcher, output = TokenMasks(ll, grammar), []
    with torch.no_grad():
        while len(output) < MAX_TOKENS:
            logits = target(input_ids=torch.tensor([prompt + output])).logits[0, -1]
            allowed = matcher.next_mask(logits.shape[-1])
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            output.append(token)
            if token == eos:
                break
            assert matcher.advance([token]) == 1
    return output


def follows(name: str, text: str) -> bool:
    kind, spec = SPECS[name]
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    return re.fullmatch(r"x = [0-9]{1,3}( \+ [0-9]{1,3}){0,3}", text) is not None


CASES = [("model", 3, False), ("model", "auto", False), ("model", 2, True),
         ("ngram", 3, False)]


@pytest.mark.parametrize("name", list(SPECS))
def test_constrained_greedy_equals_the_masked_target_alone(demo, name):
    tokenizer, target, draft, ll = demo
    grammar = compile_spec(*SPECS[name], ll)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    expected = reference(target, ll, grammar, prompt, eos)
    if name != "json_object":  # any object may go on past MAX_TOKENS (this one does)
        assert expected[-1] == eos, "the grammar did not finish within MAX_TOKENS"
        assert follows(name, text_decoder(tokenizer)(expected[:-1]))
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    drafters = {"model": ModelDrafter(draft, vocab_size=target.config.vocab_size,
                                      grammar_tokenizer=ll),
                "ngram": NgramDrafter(target.config.vocab_size, grammar_tokenizer=ll)}
    drafted = 0
    for i, (kind, k, pipelined) in enumerate([("model", 0, False), *CASES]):
        out, state = run(drafters[kind], verifier, prompt, params, k, request_id=f"r{i}",
                         stop=(eos,), pipelined=pipelined)
        assert out == expected, (name, kind, k, pipelined)
        drafted += state.stats.num_draft_tokens
    assert drafted > 0


def test_grammars_survive_rebuilds_and_drafter_failures(demo):
    """Both pools lose the request's cache (and its matcher) before half their calls, and
    the drafter fails a third of its calls after advancing: the output still equals the
    masked target alone's."""
    import random

    from tests.stats.test_engine_laws import Forgetful
    from tests.unit.test_draft_fallback import Flaky

    tokenizer, target, draft, ll = demo
    grammar = compile_spec(*SPECS["json"], ll)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    expected = reference(target, ll, grammar, prompt, eos)
    rng = random.Random(4)
    drafter = Flaky(Forgetful(ModelDrafter(draft, vocab_size=target.config.vocab_size,
                                           grammar_tokenizer=ll), seed=1),
                    lambda n: rng.random() < 0.3, after=True)
    verifier = Forgetful(ModelVerifier(target, grammar_tokenizer=ll), seed=2)
    for pipelined in (False, True):
        out, state = run(drafter, verifier, prompt, params, 3, request_id=f"p{pipelined}",
                         stop=(eos,), pipelined=pipelined)
        assert out == expected, pipelined
        assert state.stats.cache_misses > 0 and state.stats.draft_fallback_rounds > 0


def test_a_rejected_draft_that_breaks_the_matcher_ends_nothing(demo):
    """A rule llguidance cannot follow ("d" recursing forever, past what compiling probes)
    broke the verifier's matcher when a drafted "d" was tried or rolled back, and llguidance
    keeps an error through rollbacks: the target, which never takes "d" here, then had its
    next token refused as a dead end. The matcher's state is its output's alone: K = 1 and
    K = 3 give the target's own output."""
    from speculative.types import DraftBlock

    tokenizer, target, _, ll = demo
    grammar = compile_spec("grammar", 'start: /[a-z]{12}/ (b | "x")\nb: "d" b', ll)
    [d], [x] = (tokenizer(s, add_special_tokens=False)["input_ids"] for s in "dx")
    eos = tokenizer.eos_token_id

    class DraftsD:
        async def propose(self, call):
            return DraftBlock((d,) * call.num_speculative_tokens, None)

        async def release(self, request_id):
            pass

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar,
                            logit_bias=((x, 30.0),))
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    outputs = [run(DraftsD(), verifier, prompt, params, k, request_id=f"d{k}", stop=(eos,))[0]
               for k in (0, 1, 3)]
    assert outputs[0] == [x] * 13 + [eos] and outputs[1] == outputs[2] == outputs[0]


def test_an_output_the_grammar_refuses_is_a_dead_end_the_client_learns_of(demo):
    """A committed output the matcher refuses (a rule deeper than the compile-time probe
    that breaks llguidance, here a token the regex forbids) ends the request with a 400
    naming the grammar, not a 503 "retry later" that retrying never mends."""
    import grpc

    from deployments.replica_stream import pool_error
    from deployments.ingress import pool_failure
    from deployments.pools import PoolReplica
    from protos import specserve_pb2 as pb
    from speculative.token_masks import GrammarDeadEnd

    tokenizer, _, _, ll = demo
    masks = TokenMasks(ll, compile_spec("regex", "[a-z]+", ll))
    output = tokenizer("ab1", add_special_tokens=False)["input_ids"]
    with pytest.raises(GrammarDeadEnd, match="breaks the request's grammar") as dead:
        masks.masks(output, [], 4096)
    replica = PoolReplica.__new__(PoolReplica)
    replica.replica_id = "v"
    _, code = replica.respond(dead.value, None, pb.ScoreResponse)
    assert code == grpc.StatusCode.OUT_OF_RANGE
    answer = pool_failure(pool_error("verifier", code, str(dead.value)))
    assert answer.status == 400 and "grammar" in str(answer)


def test_a_row_the_grammar_leaves_nothing_stays_whole_not_nan():
    """speculative.grammar.masked: a row allowing no token is left as it was (a softmax of
    all -inf would be NaN), the other rows masked."""
    from speculative.token_masks import masked

    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    allowed = torch.tensor([[True, False, True], [False, False, False]])
    out = masked(logits, allowed)
    assert out[0].tolist() == [1.0, float("-inf"), 3.0] and torch.equal(out[1], logits[1])


def test_the_model_drafter_masks_q_as_the_verifier_masks_p(demo):
    """drafter.draft.processed: a constrained draft's row is masked by its grammar where it
    stands (an unmasked q stays exact, the verifier rejecting what it forbids, but drafts
    tokens that cannot be accepted); an unconstrained draft's row beside it is left as it was,
    and a row the grammar has moved along is masked after the tokens taken."""
    from types import SimpleNamespace

    from drafter.draft import processed

    tokenizer, target, _, ll = demo
    vocab = target.config.vocab_size
    grammar = compile_spec(*SPECS["regex"], ll)
    lines = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    later = TokenMasks(ll, grammar)
    assert later.advance(tokenizer("def", add_special_tokens=False)["input_ids"]) > 0
    drafts = [SimpleNamespace(matcher=TokenMasks(ll, grammar), shaping=lambda row: None),
              SimpleNamespace(matcher=None, shaping=lambda row: None),
              SimpleNamespace(matcher=later, shaping=lambda row: None)]
    out = processed(drafts, lines)
    for row, matcher in ((0, TokenMasks(ll, grammar)), (2, later)):
        allowed = matcher.next_mask(vocab)
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(out[row], lines[row].masked_fill(~allowed, float("-inf")))
    assert torch.equal(out[1], lines[1])


def test_a_constrained_outputs_logprobs_are_of_the_masked_law_as_vllms_raw_logprobs(demo):
    """vLLM's default logprobs (raw_logprobs) are read after the grammar's bitmask and before
    logit_bias, penalties and temperature: a constrained output's logprobs and top n are the
    masked target's, so a choice's tokens' probabilities are over the allowed ones (a forced
    token's is 1). They were the unmasked target's: the top n held tokens the grammar
    forbids, and a forced token's logprob was whatever the model gave it. Speculation
    (K = 3) gives K = 0's; the logit_bias, which comes after, changes none."""
    tokenizer, target, draft, ll = demo
    grammar = compile_spec(*SPECS["choice"], ll)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar, logprobs=5,
                            logit_bias=((eos, 5.0),))
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    drafter = ModelDrafter(draft, vocab_size=target.config.vocab_size, grammar_tokenizer=ll)
    runs = [run(drafter, verifier, prompt, params, k, request_id=f"m{k}", stop=(eos,))
            for k in (0, 3)]
    out, state = runs[1]
    assert runs[0][0] == out and out[-1] == eos
    matcher = TokenMasks(ll, grammar)
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:]
    for i, entry in enumerate(state.logprobs):
        allowed = matcher.next_mask(logits.shape[-1])
        law = torch.log_softmax(logits[i].masked_fill(~allowed, float("-inf")).float(), -1)
        assert abs(entry.logprob - float(law[entry.token_id])) < 1e-3
        values, ids = torch.topk(law, 5)
        finite = [(t, v) for t, v in entry.top if v > float("-inf")]  # -inf ties: any order
        assert [t for t, _ in finite] == ids[:int(allowed.sum())].tolist()
        assert all(abs(v - float(law[t])) < 1e-3 for t, v in finite)
        assert abs(entry.logprob - runs[0][1].logprobs[i].logprob) < 1e-3
        if out[i] != eos:
            matcher.advance([out[i]])


class Reads(list):
    """A list that counts the items Python reads of it one at a time (iterated or indexed);
    a slice is a plain list, which compares in C."""

    reads = 0

    def __iter__(self):
        for item in list.__iter__(self):
            self.reads += 1
            yield item

    def __getitem__(self, index):
        if not isinstance(index, slice):
            self.reads += 1
        return list.__getitem__(self, index)


def test_following_a_long_output_reads_only_its_end_in_python(demo):
    """A call's TokenMasks.follow over 10,000 committed tokens, after a round whose last
    drafted token was rejected, rolls that token back and takes the new one reading a few
    tokens one at a time, not the whole output (a scan in Python: 1.35 ms a call at 32k
    tokens), and allows what a fresh matcher that followed the output allows."""
    tokenizer, target, _, ll = demo
    vocab = target.config.vocab_size
    grammar = compile_spec("regex", "[a-z ]*", ll)
    letters = tokenizer("a b c d e", add_special_tokens=False)["input_ids"]
    output = (letters * 2000)[:10_000]
    other = next(token for token in letters if token != output[-1])
    masks = TokenMasks(ll, grammar)
    masks.masks(output[:-3], output[-3:-1] + [other], vocab)  # its third drafted is rejected
    read = Reads(output)
    assert masks.follow(read) == len(output) and read.reads < 64
    fresh = TokenMasks(ll, grammar)
    assert fresh.follow(output) == len(output)
    assert masks.consumed == output
    assert torch.equal(masks.next_mask(vocab), fresh.next_mask(vocab))


# vLLM's structural tag: free text in which each `return (` opens a JSON string, then ")"
RETURN_TAG = {"structures": [{"begin": "return (", "end": ")",
                              "schema": {"type": "string", "maxLength": 12}}],
              "triggers": ["return ("]}


def test_a_structural_tag_holds_each_structure_its_trigger_opens_exact_under_speculation(demo):
    """vLLM's structural tag (its guidance backend's form, built by llguidance's StructTag):
    the text is free until a trigger, then the structure's schema and end are forced; greedy
    output equals the masked target alone under every drafter, and the tag did fire (the
    demo target writes `return (\n "The "error"` unconstrained)."""
    tokenizer, target, draft, ll = demo
    grammar = compile_spec("structural_tag", RETURN_TAG, ll)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar)
    prompt = tokenizer("raise ValueError(", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    expected = reference(target, ll, grammar, prompt, eos)
    text = text_decoder(tokenizer)(expected)
    opened = [m.end() for m in re.finditer(re.escape("return ("), text)]
    assert opened and all(re.match(r'"[^"]{0,12}"\)', text[at:]) for at in opened), text
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    drafter = ModelDrafter(draft, vocab_size=target.config.vocab_size, grammar_tokenizer=ll)
    for i, (k, pipelined) in enumerate([(0, False), (3, False), (2, True)]):
        out, _ = run(drafter, verifier, prompt, params, k, request_id=f"t{i}", stop=(eos,),
                     pipelined=pipelined)
        assert out == expected, (k, pipelined)


def test_each_drafted_token_follows_the_grammar_after_the_ones_before_it(demo):
    """The drafter's matcher moves with its block: each drafted token is one the grammar
    allows after the committed output, the assumed tokens (a pre-draft's) and the block's
    tokens before it."""
    tokenizer, target, draft, ll = demo
    vocab = target.config.vocab_size
    grammar = compile_spec(*SPECS["grammar"], ll)
    prompt = tuple(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    drafter = ModelDrafter(draft, vocab_size=vocab, grammar_tokenizer=ll)
    call = ProposeCall("g", PrefixSync(0, EMPTY_PREFIX_HASH, prompt), 6,
                       SamplingParams(temperature=0, grammar=grammar), seed=0,
                       prompt_len=len(prompt))
    block = drafter.propose_now(call).token_ids
    # a pre-draft assuming the block's first two tokens
    pre = drafter.propose_now(replace(call, request_id="p", assumed_token_ids=block[:2]))
    assert len(block) == len(pre.token_ids) == 6
    for drafted in (block, block[:2] + pre.token_ids):
        matcher = TokenMasks(ll, grammar)
        for token in drafted:
            assert matcher.next_mask(vocab)[token]
            matcher.advance([token])
