"""vLLM 0.32's `qwen3` reasoning parser ends the reasoning implicitly at a `<tool_call>`
(vllm/parser/qwen3.py: the transition REASONING -> TOOL_PREAMBLE on TOOL_START, with
REASONING_END), the tag itself the content's: the split, whole and streamed (a tag cut
across deltas), the call read out of the content, usage's reasoning tokens (the tokens
before its id), the prompt read as ended (is_reasoning_end: its last marker a `<tool_call>`),
and a grammar after the reasoning that starts AT its id (vLLM's grammar_start = the end's
offset, constraint_start after it), exact under speculation. `deepseek_r1` is unchanged (a
`<tool_call>` inside the reasoning is reasoning), and so is the thinking budget (vLLM's reads
the `</think>` ids alone). The expected splits and counts are vLLM 0.32's own, read off its
parser on a tokenizer holding the tags whole."""

from types import SimpleNamespace

import pytest
import torch

from deployments.openai_api import ChatCompletionRequest
from deployments.reasoning import (ReasoningSplit, ThinkTokens, grammar_gate, prompt_ids_ended,
                                   request_split)
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.grammar import compile_spec
from speculative.sampling import SamplingParams
from speculative.thinking import ThinkingBudget, ThinkingTracker
from speculative.token_masks import GrammarDeadEnd, TokenMasks, matcher_after
from specserve.demo import train_tokenizer
from tests.tiny import run
from tests.unit.test_reasoning import (CALL, TOOLS, accumulated, usages,
                                       whole_and_streamed)
from tests.unit.test_reasoning_grammar import CASES, ENDS, MAX_TOKENS, PROMPT
from tests.unit.test_structured import SPECS, demo_pair
from verifier.engine import ModelVerifier

# an output's text: its (reasoning, content) under qwen3, as vLLM 0.32's parser splits it
QWEN3_SPLITS = [
    ("I should call." + CALL, ("I should call.", CALL)),
    ("<think>a\n\n<tool_call>x", ("a\n\n", "<tool_call>x")),  # the whitespace is reasoning
    ("  \n<tool_call>x", ("  \n", "<tool_call>x")),
    ("<tool_call>x", ("", "<tool_call>x")),
    ("a</think>b<tool_call>c", ("a", "b<tool_call>c")),  # after the end: content as ever
    ("a <tool_call", ("a <tool_call", None)),  # a tag cut short is text
    ("<think>no call", ("no call", None)),
]


def qwen_tokenizer():
    """A small trained tokenizer holding Qwen3's tags whole (each one id, as Qwen3's
    vocabulary holds them) and its turn boundaries."""
    tokenizer = train_tokenizer(["hello world, I should call the tool\n"] * 8, vocab_size=300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    return tokenizer


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.mark.parametrize("text, split", QWEN3_SPLITS)
def test_qwen3_ends_the_reasoning_at_a_tool_call_whole_and_streamed(text, split):
    assert ReasoningSplit("qwen3").split(text) == split
    for size in (1, 2, 3, 7, max(len(text), 1)):
        stream, reasoning, content = ReasoningSplit("qwen3").stream(), "", ""
        for start in range(0, len(text), size):
            thought, said = stream.feed(text[start:start + size])
            reasoning, content = reasoning + thought, content + said
            assert "<tool_call>" not in reasoning
        held, tail = stream.finish()
        assert (reasoning + held, (content + tail) or None) == split, (text, size)
    if "</think>" not in text:  # deepseek_r1's: all of it reasoning
        assert ReasoningSplit("deepseek_r1").split(text)[1] is None


def test_a_call_that_ends_the_reasoning_is_read_out_of_the_content():
    """No `</think>`: the reasoning ends at the call, which is read as any (the tool call
    parser reads the content, which begins with it); deepseek_r1 keeps it reasoning."""
    text = "I should ask the time." + CALL
    whole, deltas = whole_and_streamed(text, parser="qwen3", tools=TOOLS)
    message = whole["message"]
    assert message["reasoning"] == "I should ask the time." and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    assert whole["finish_reason"] == "tool_calls" == deltas[-1]["finish_reason"]
    assert [c["function"]["name"] for d in deltas for c in d["delta"].get("tool_calls", [])] \
        == ["now"]
    assert accumulated(deltas, "reasoning") == "I should ask the time."
    other, _ = whole_and_streamed(text, parser="deepseek_r1", tools=TOOLS)
    assert other["message"]["reasoning"] == text and "tool_calls" not in other["message"]


def test_the_tags_ids_and_the_reasoning_tokens_count_up_to_the_call(qwen):
    """qwen3's implicit end is `<tool_call>`'s one id (vLLM finds it by vocab.get); usage
    counts the tokens before it, less an opening `<think>`'s (vLLM's 2 for
    "<think>a\\n\\n<tool_call>x")."""
    tags, other = ThinkTokens.of(qwen, "qwen3"), ThinkTokens.of(qwen, "deepseek_r1")
    call = qwen.convert_tokens_to_ids("<tool_call>")
    assert tags.implicit == (call,) and other.implicit == () and other.end == tags.end
    for text in ["<think>hello world<tool_call>{}</tool_call>", "hello world<tool_call>x",
                 "hello</think>world<tool_call>x", "<tool_call>x", "hello world"]:
        ids = qwen.encode(text, add_special_tokens=False)
        thought = ReasoningSplit("qwen3").split(text)[0]
        assert tags.count(ids) == len(qwen.encode(thought, add_special_tokens=False)), text
    ids = qwen.encode("<think>hello world<tool_call>x", add_special_tokens=False)
    assert other.count(ids) == len(ids) - 1  # (deepseek_r1's: all after its `<think>`)
    # a character a token: the call at char 6, token 16
    for usage in usages("Paris?" + CALL, parser="qwen3", think_tokens=ThinkTokens(
            (), (999,), implicit=(16,), inner_starts=True)):
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 6}


def test_a_prompt_whose_last_marker_is_a_call_ended_its_reasoning(qwen):
    """vLLM's is_reasoning_end of the prompt's ids: read backwards from its end, a
    `</think>` or `<tool_call>` before a `<think>` or a turn boundary; the grammar then
    holds from the output's first token. A continued reply's text is read so too."""
    tags = ThinkTokens.of(qwen, "qwen3")
    for prompt, ended in [("<|im_start|>assistant\n<think>x<tool_call>", True),
                          ("<|im_start|>assistant\n<think>x", False),
                          ("<tool_call><|im_start|>assistant\n", False),
                          ("<|im_start|>assistant\nx</think>y<tool_call>", True),
                          ("<|im_start|>assistant\n<tool_call>x<think>y", False)]:
        ids = qwen.encode(prompt, add_special_tokens=False)
        assert prompt_ids_ended("qwen3", tags, ids) == ended, prompt
        assert grammar_gate("qwen3", tags, None, False, ids) == \
            (((), ()) if ended else (tags.end, tags.implicit)), prompt
    ids = qwen.encode("<think>x<tool_call>", add_special_tokens=False)
    other = ThinkTokens.of(qwen, "deepseek_r1")
    assert grammar_gate("deepseek_r1", other, None, False, ids) == (other.end, ())
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "?"},
                      {"role": "assistant", "content": "<think>a<tool_call>"}],
         "add_generation_prompt": False, "continue_final_message": True})
    plan = SimpleNamespace(choices=[])
    assert grammar_gate("qwen3", tags, body, True, []) == ((), ())
    assert request_split("qwen3", body, plan) is None
    assert grammar_gate("deepseek_r1", other, body, True, []) == (other.end, ())
    assert request_split("deepseek_r1", body, plan) == ReasoningSplit("deepseek_r1")


def test_the_thinking_budget_counts_on_through_a_call(qwen):
    """vLLM 0.32's ThinkingBudgetStateHolder reads the `</think>` ids alone: a `<tool_call>`
    inside a section ends nothing, and the budget forces `</think>` there too."""
    tags = ThinkTokens.of(qwen, "qwen3")
    call = qwen.convert_tokens_to_ids("<tool_call>")
    tracker = ThinkingTracker(ThinkingBudget(3, tags.start, tags.end), list(tags.start))
    for token in (5, call, 6):
        assert tracker.forced() is None
        tracker.advance(token)
    assert tracker.inside and tracker.forced() == tags.end[0]


# --- the grammar's gate at an implicit end, on the demo pair ---

DEF = 317  # the demo target's greedy output opens "\n" "def" " _" "get" ...: "def" ends it


@pytest.fixture(scope="module")
def demo():
    tokenizer, target, draft, ll = demo_pair()
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    return tokenizer, target, draft, ll, prompt, compile_spec(*SPECS["regex"], ll)


def reference(target, ll, grammar, ends, at, prompt, eos) -> list[int]:
    """Gated greedy decoding written out: every id free until the end ids are whole or an
    `at` id is drawn (free too); a fresh matcher then consumes the `at` id itself (vLLM's
    grammar_start at it), or the tokens after the end ids."""
    matcher, output, opened = TokenMasks(ll, grammar), [], False
    with torch.no_grad():
        while len(output) < MAX_TOKENS:
            logits = target(input_ids=torch.tensor([prompt + output])).logits[0, -1]
            if opened:
                logits = logits.masked_fill(~matcher.next_mask(logits.shape[-1]),
                                            float("-inf"))
            token = int(logits.argmax())
            output.append(token)
            if token == eos:
                break
            if opened or token in at:
                opened = True
                assert matcher.advance([token]) == 1
            elif output[-len(ends):] == list(ends):
                opened = True
    return output


def pools(target, draft, ll) -> dict:
    vocab = target.config.vocab_size
    return {"model": ModelDrafter(draft, vocab_size=vocab, grammar_tokenizer=ll),
            "ngram": NgramDrafter(vocab, grammar_tokenizer=ll)}


def test_greedy_with_an_implicit_end_equals_the_gated_target_alone(demo, monkeypatch):
    import verifier.engine

    tokenizer, target, draft, ll, prompt, grammar = demo
    ends, eos = ENDS["two ids"], tokenizer.eos_token_id
    expected = reference(target, ll, grammar, ends, (DEF,), prompt, eos)
    assert expected[:2] == [199, DEF] and expected[-1] == eos
    assert tokenizer.decode(expected[1:-1]).startswith("def ")
    # the grammar from "def" itself: not as the explicit end's (after it), nor without it
    assert expected != reference(target, ll, grammar, (DEF,), (), prompt, eos)
    assert expected != reference(target, ll, grammar, ends, (), prompt, eos)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar,
                            grammar_after=ends, grammar_at=(DEF,))
    drafters, drafted = pools(target, draft, ll), 0
    for i, (kind, k, pipelined, steps) in enumerate(CASES):
        out, state = run(drafters[kind], ModelVerifier(target, grammar_tokenizer=ll), prompt,
                         params, k, request_id=f"i{i}", stop=(eos,), pipelined=pipelined,
                         plain_steps=steps)
        assert out == expected, (kind, k, pipelined, steps)
        drafted += state.stats.num_draft_tokens
    assert drafted > 0
    real = verifier.engine.request_matcher  # a verifier that predates grammar_at_ids
    monkeypatch.setattr(verifier.engine, "request_matcher", lambda holder, sampling, tok: real(
        holder, SamplingParams(temperature=0, grammar=sampling.grammar,
                               grammar_after=sampling.grammar_after), tok))
    for k in (0, 3):
        out, _ = run(drafters["model"], ModelVerifier(target, grammar_tokenizer=ll), prompt,
                     params, k, request_id=f"old{k}", stop=(eos,))
        assert out != expected, k


def test_every_party_gates_a_block_at_its_implicit_end(demo):
    """A block drafted across the `at` id: the rows up to it, its own included, allow
    every id (vLLM's constraint_start after it), the rows after it are a fresh matcher's
    after consuming it; the n-gram drafter's allowed prefix validates it with the grammar;
    an explicit end whole before it wins; an `at` id the grammar refuses breaks it."""
    tokenizer, target, _, ll, prompt, grammar = demo
    ends = ENDS["two ids"]
    expected = reference(target, ll, grammar, ends, (DEF,), prompt, tokenizer.eos_token_id)
    drafted, vocab = expected[:6], target.config.vocab_size
    fresh, everything = TokenMasks(ll, grammar), torch.ones(vocab, dtype=torch.bool)
    grammar_rows = []
    for token in drafted[1:]:
        assert fresh.advance([token]) == 1
        grammar_rows.append(fresh.next_mask(vocab))
    want = torch.stack([everything] * 2 + grammar_rows)
    sampling = SamplingParams(temperature=0, grammar=grammar, grammar_after=ends,
                              grammar_at=(DEF,))
    call = SimpleNamespace(sampling=sampling, prompt_len=len(prompt))
    sequence = SimpleNamespace(committed=list(prompt), constraint=None)
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    assert torch.equal(verifier.allowed(call, sequence, drafted), want)
    matcher, rows = matcher_after(SimpleNamespace(constraint=None), sampling, ll, []), []
    for token in drafted:
        rows.append(matcher.next_mask(vocab))
        assert matcher.advance([token]) == 1
    assert torch.equal(torch.stack(rows + [matcher.next_mask(vocab)]), want)
    matcher = matcher_after(SimpleNamespace(constraint=None), sampling, ll, [])
    newline = expected[0]  # free before the end, refused by the grammar after it
    assert matcher.allowed_prefix(drafted) == 6
    assert matcher.allowed_prefix([newline, DEF, newline]) == 2
    assert matcher.allowed_prefix([newline, newline, newline]) == 3
    # followed back and forth: a rejected `at` id moves the gate back
    assert matcher.follow(expected[:4]) == 4 and matcher.opened
    assert matcher.follow(expected[:1]) == 1 and not matcher.opened
    assert matcher.follow(expected[:1] + [newline]) == 2 and not matcher.opened
    assert torch.equal(matcher.next_mask(vocab), everything)
    # the end ids whole first: the grammar after them, the later `at` id its own
    free = reference(target, ll, grammar, (10 ** 6,), (), prompt, tokenizer.eos_token_id)
    late = TokenMasks(ll, grammar, ends, (free[12],))
    assert late.follow(free[:12]) == 12 and late.opened and not late.implicit
    refused = TokenMasks(ll, grammar, ends, (free[2],))  # " _": no method head opens so
    assert refused.allowed_prefix(free[:3]) == 2
    with pytest.raises(GrammarDeadEnd):
        refused.masks(free[:3], [], vocab)


def test_the_implicit_ends_travel_and_an_older_verifier_is_refused(demo):
    from deployments import wire
    from deployments.pool_handles import gated
    from deployments.wire import sampling_from_proto, sampling_to_proto
    from protos import specserve_pb2 as pb
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.types import PoolUnavailable, PrefixSync, ScoreCall
    from verifier.host import to_host

    _, target, _, ll, prompt, grammar = demo
    params = SamplingParams(temperature=0, grammar=grammar, grammar_after=(7,),
                            grammar_at=(8,))
    assert sampling_from_proto(sampling_to_proto(params)) == params
    with pytest.raises(ValueError, match="grammar_at"):
        SamplingParams(temperature=0, grammar=grammar, grammar_at=(8,))
    call = ScoreCall("at", PrefixSync(0, EMPTY_PREFIX_HASH, tuple(prompt)), (),
                     SamplingParams(temperature=0, grammar=grammar,
                                    grammar_after=ENDS["one id"], grammar_at=(DEF,)),
                     prompt_len=len(prompt))
    [scores] = to_host(ModelVerifier(target, grammar_tokenizer=ll).score_batch([call]))
    back = wire.scores_from_proto(pb.ScoreResponse.FromString(
        wire.scores_to_proto(scores).SerializeToString()))
    assert back.grammar_gated and back.grammar_at_gated and gated(call, back) is back
    older = wire.scores_from_proto(pb.ScoreResponse(
        greedy=pb.GreedyScores(target_token_ids=[1]), grammar_gated=True))
    with pytest.raises(PoolUnavailable, match="one version"):
        gated(call, older)
