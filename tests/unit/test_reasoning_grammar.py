"""A grammar after the reasoning (vLLM 0.32's structured outputs under a reasoning parser),
exact under speculation, on the demo pair and its tokenizer.

The reference, written here: the target alone, the whole sequence forwarded each step, its
argmax over every id until the reasoning's end ids stand whole in the output, then its
argmax among the tokens a fresh llguidance matcher allows after the tokens that followed
them. Speculative greedy output equals it at K = 0 (one plain step a call, or several),
3 and auto, pipelined and not, with the draft model and the n-gram drafter; the drafter, the
n-gram drafter and the verifier gate each drafted position alike; a verifier that gates one
position late fails the same check, and a drafter that does not gate drafts nothing inside
the reasoning. The end ids here are
ids the demo target writes itself (its `</think>` it never writes): the gate reads ids
alone. The router's choice of the gate (deployments.reasoning.grammar_gate) is checked on
its prompt reader, where a prompt that ended the reasoning constrains from the first token.
"""

from types import SimpleNamespace

import pytest
import torch

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.grammar import compile_spec
from speculative.token_masks import TokenMasks, matcher_after, reasoning_end
from speculative.prefixes import found_in
from speculative.sampling import SamplingParams
from tests.tiny import run
from tests.unit.test_structured import SPECS, demo_pair
from verifier.engine import ModelVerifier

PROMPT = "def main():\n"
# the target's greedy output opens "\ndef _get_from_cache(obj):\n    ..."; the gate
# closes after "):" "\n   " (ids 10 and 11 of it), a grammar of a method head after it
ENDS = {"two ids": (309, 274), "one id": (274,)}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def demo():
    tokenizer, target, draft, ll = demo_pair()
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    return tokenizer, target, draft, ll, prompt, compile_spec(*SPECS["regex"], ll)


def reference(target, ll, grammar: str, ends: tuple[int, ...], prompt: list[int],
              eos: int, free: tuple[int, ...] = ()) -> list[int]:
    """Gated greedy decoding written out: every id until the end ids are in the output,
    then a fresh matcher on the tokens after them; a full forward per token. free: stop
    ids (besides eos) that stop the output only once the grammar holds (vLLM's end tokens
    under ignore_eos)."""
    matcher, output, start = TokenMasks(ll, grammar), [], None
    with torch.no_grad():
        while len(output) < MAX_TOKENS:
            logits = target(input_ids=torch.tensor([prompt + output])).logits[0, -1]
            if start is not None:
                allowed = matcher.next_mask(logits.shape[-1])
                logits = logits.masked_fill(~allowed, float("-inf"))
            token = int(logits.argmax())
            output.append(token)
            if token == eos or token in free and start is not None:
                break
            if start is not None:
                assert matcher.advance([token]) == 1
            elif output[-len(ends):] == list(ends):
                start = len(output)
    return output


def drafters(target, draft, ll) -> dict:
    vocab = target.config.vocab_size
    return {"model": ModelDrafter(draft, vocab_size=vocab, grammar_tokenizer=ll),
            "ngram": NgramDrafter(vocab, grammar_tokenizer=ll)}


# (drafter, K, pipelined, the verifier's plain steps a round without a draft)
CASES = [("model", 0, False, 1), ("model", 0, False, 4), ("model", 3, False, 1),
         ("model", "auto", False, 1), ("model", 3, True, 1), ("model", "auto", True, 1),
         ("ngram", 3, False, 1)]


@pytest.mark.parametrize("ends", list(ENDS.values()), ids=list(ENDS))
def test_greedy_under_a_grammar_after_the_reasoning_equals_the_gated_target_alone(demo,
                                                                                   ends):
    tokenizer, target, draft, ll, prompt, grammar = demo
    eos = tokenizer.eos_token_id
    expected = reference(target, ll, grammar, ends, prompt, eos)
    start = found_in(expected, ends, 0)
    # the reasoning is free (its first token, "\n", is one the grammar forbids), the rest
    # follows the grammar to its end
    assert start == 12 and expected[-1] == eos
    assert tokenizer.decode(expected[start:-1]).startswith("def ")
    assert expected != reference(target, ll, grammar, (), prompt, eos)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar,
                            grammar_after=ends)
    verifier, pools = ModelVerifier(target, grammar_tokenizer=ll), drafters(target, draft, ll)
    drafted = 0
    for i, (kind, k, pipelined, steps) in enumerate(CASES):
        out, state = run(pools[kind], verifier, prompt, params, k, request_id=f"g{i}",
                         stop=(eos,), pipelined=pipelined, plain_steps=steps)
        assert out == expected, (kind, k, pipelined, steps)
        drafted += state.stats.num_draft_tokens
    assert drafted > 0


def test_ignore_eos_goes_on_past_the_end_token_inside_the_reasoning_alone(demo):
    """vLLM 0.32 under ignore_eos: the end token inside the reasoning is sampled (no grammar
    masks it yet) and ends nothing; once the grammar holds it is the grammar's stop, as
    this server keeps it for a constrained output. Here an id the target writes inside the
    reasoning plays the end token (Request.free_in_reasoning): the output goes on past it,
    equal to the reference, at K = 0 (one plain step a call, or several: the verifier's
    steps end at it, the next call goes on), 3, auto and pipelined."""
    tokenizer, target, draft, ll, prompt, grammar = demo
    eos, ends = tokenizer.eos_token_id, ENDS["two ids"]
    gated = reference(target, ll, grammar, ends, prompt, eos)
    # an id inside the reasoning (which ends at 12), not after it
    end = next((token,) for at, token in enumerate(gated[:12]) if token not in gated[at + 1:])
    expected = reference(target, ll, grammar, ends, prompt, eos, free=end)
    assert expected == gated
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar,
                            grammar_after=ends)
    verifier, pools = ModelVerifier(target, grammar_tokenizer=ll), drafters(target, draft, ll)
    for i, (kind, k, pipelined, steps) in enumerate(CASES):
        out, _ = run(pools[kind], verifier, prompt, params, k, request_id=f"e{i}",
                     stop=(eos, *end), pipelined=pipelined, plain_steps=steps,
                     free_in_reasoning=end)
        assert out == expected, (kind, k, pipelined, steps)
    # after the reasoning, the same id is a stop: the grammar's first token plays it
    after = (gated[12],)
    out, _ = run(pools["model"], verifier, prompt, params, 3, request_id="after",
                 stop=(eos, *after), free_in_reasoning=after)
    assert out == gated[:13]


def test_every_party_gates_a_drafted_block_where_the_end_ids_fall_in_it(demo):
    """One block drafted across the reasoning's end: the rows up to the end ids allow every
    id, the rows after them are a fresh matcher's on the tokens after them, for the
    verifier's masks, the model drafter's (next_mask, advance) and the n-gram drafter's
    allowed prefix alike."""
    tokenizer, target, _, ll, prompt, grammar = demo
    ends = ENDS["two ids"]
    expected = reference(target, ll, grammar, ends, prompt, tokenizer.eos_token_id)
    output, drafted = expected[:9], expected[9:15]  # the end ids at drafted[1:3]
    assert drafted[1:3] == list(ends)
    vocab = target.config.vocab_size
    fresh = TokenMasks(ll, grammar)
    grammar_rows = [fresh.next_mask(vocab)]
    for token in drafted[3:]:
        assert fresh.advance([token]) == 1
        grammar_rows.append(fresh.next_mask(vocab))
    everything = torch.ones(vocab, dtype=torch.bool)
    want = torch.stack([everything] * 3 + grammar_rows)  # [len(drafted) + 1, V]
    sampling = SamplingParams(temperature=0, grammar=grammar, grammar_after=ends)
    call = SimpleNamespace(sampling=sampling, prompt_len=len(prompt))
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    sequence = SimpleNamespace(committed=prompt + output, constraint=None)
    assert torch.equal(verifier.allowed(call, sequence, drafted), want)
    holder = SimpleNamespace(constraint=None)
    matcher = matcher_after(holder, sampling, ll, output)
    rows = []
    for token in drafted:
        rows.append(matcher.next_mask(vocab))
        assert matcher.advance([token]) == 1
    assert torch.equal(torch.stack(rows + [matcher.next_mask(vocab)]), want)
    # the n-gram drafter's: a proposal the grammar forbids inside the reasoning is whole,
    # one it forbids after the end ids is cut there
    matcher = matcher_after(SimpleNamespace(constraint=None), sampling, ll, output)
    forbidden = expected[0]  # "\n": no method head starts with it
    assert matcher.allowed_prefix(drafted) == len(drafted)
    assert matcher.allowed_prefix([forbidden] + drafted[1:3]) == 3
    assert matcher.allowed_prefix(drafted[:3] + [forbidden]) == 3
    assert matcher.allowed_prefix(drafted[:4] + [forbidden]) == 4
    # the same matcher followed back and forth: a rejected end moves the gate back
    assert matcher.follow(expected[:14]) == 14 and matcher.opened
    assert matcher.follow(expected[:10]) == 10 and not matcher.opened
    assert torch.equal(matcher.masks(expected[:10], drafted[1:], vocab), want[1:])


class LateMasks(TokenMasks):
    """A mutant: the grammar holds one token after the end ids, not at once."""

    def reasoned(self, tokens: list[int]) -> int:
        if self.opened:
            return 0
        start = len(self.head)
        self.head.extend(tokens)
        end = found_in(self.head, self.after, 0)
        if end is None or end >= len(self.head):
            return len(tokens)
        del self.head[end + 1:]
        self.opened = True
        return end + 1 - start


def test_a_verifier_gating_one_position_late_fails_the_check(demo, monkeypatch):
    import verifier.engine

    tokenizer, target, draft, ll, prompt, grammar = demo
    ends, eos = ENDS["two ids"], tokenizer.eos_token_id
    expected = reference(target, ll, grammar, ends, prompt, eos)

    def late(holder, sampling, tokenizer):
        if not isinstance(getattr(holder, "constraint", None), LateMasks):
            holder.constraint = LateMasks(tokenizer, sampling.grammar, sampling.grammar_after)
        return holder.constraint

    monkeypatch.setattr(verifier.engine, "request_matcher", late)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, grammar=grammar,
                            grammar_after=ends)
    model = drafters(target, draft, ll)["model"]
    for k in (0, 3):
        out, _ = run(model, ModelVerifier(target, grammar_tokenizer=ll), prompt, params, k,
                     request_id=f"late{k}", stop=(eos,))
        assert out != expected, k


def test_a_drafter_that_does_not_gate_drafts_nothing_inside_the_reasoning(demo, monkeypatch):
    """Exactness is the verifier's (a drafter masking from the first token only drafts
    less), so the drafter's gate shows in its drafts: inside the reasoning the grammar
    forbids what the output holds, and a drafter masking from the first token drafts
    nothing there."""
    import drafter.model

    tokenizer, target, draft, ll, prompt, grammar = demo
    ends, eos = ENDS["two ids"], tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=12, grammar=grammar, grammar_after=ends)
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    _, gated = run(drafters(target, draft, ll)["model"], verifier, prompt, params, 3,
                   request_id="gated", stop=(eos,))
    real = drafter.model.matcher_after
    monkeypatch.setattr(drafter.model, "matcher_after", lambda holder, sampling, *rest: real(
        holder, SamplingParams(temperature=0, grammar=sampling.grammar), *rest))
    _, ungated = run(drafters(target, draft, ll)["model"], verifier, prompt, params, 3,
                     request_id="ungated", stop=(eos,))
    assert gated.stats.num_accepted_tokens > 0
    assert ungated.stats.num_draft_tokens <= 3  # its first block alone, before any output


def test_the_router_gates_a_grammar_unless_the_prompt_ended_the_reasoning():
    """deployments.reasoning.grammar_gate through the prompt reader: the `</think>` ids of
    the tokenizer for a chat, a completion whose prompt has not ended its reasoning and a
    forced tool call; none (the grammar from the first token) for include_reasoning false,
    qwen3's enable_thinking false, a continued message that closed its reasoning, a
    completion whose prompt did, and without a parser. The split follows."""
    import asyncio

    from deployments.openai_api import ChatCompletionRequest, CompletionRequest
    from deployments.reasoning import ThinkTokens, request_split
    from tests.unit.test_thinking_budget import CHAT, demo_reader

    schema = {"type": "json_object"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chats = {"chat": {}, "hidden": {"include_reasoning": False},
             "no thinking": {"chat_template_kwargs": {"enable_thinking": False}},
             "continued": {"messages": CHAT + [{"role": "assistant", "content": "a</think>"}],
                           "continue_final_message": True, "add_generation_prompt": False},
             "tool": {"tools": [tool], "tool_choice": "required", "response_format": None}}
    for parser in ("qwen3", "deepseek_r1"):
        reader = demo_reader(parser)
        tags = ThinkTokens.of(reader.tokenizer)
        gated = {name: asyncio.run(reader.read(ChatCompletionRequest(**{
            "messages": CHAT, "response_format": schema, **fields}), True)).sampling
            for name, fields in chats.items()}
        want = {"chat": tags.end, "hidden": (), "no thinking": (), "continued": (),
                "tool": tags.end}
        if parser == "deepseek_r1":  # Qwen3's template alone reads enable_thinking
            want["no thinking"] = tags.end
        assert {name: s.grammar_after for name, s in gated.items()} == want, parser
        for name, sampling in gated.items():
            body = SimpleNamespace(template_kwargs=lambda: chats[name].get(
                "chat_template_kwargs", {}), include_reasoning=True,
                continue_final_message=False)
            plan = SimpleNamespace(choices=[SimpleNamespace(request=SimpleNamespace(
                sampling=sampling))])
            assert (request_split(parser, body, plan) is not None) == bool(want[name])
        for prompt, ends in (("x", tags.end), ("<think>x</think>", ()),
                             ("</think><think>x", tags.end)):
            body = CompletionRequest(prompt=prompt, response_format=schema)
            assert asyncio.run(reader.read(body, False)).sampling.grammar_after == ends
    plain = asyncio.run(demo_reader().read(ChatCompletionRequest(
        messages=CHAT, response_format=schema), True))
    assert plain.sampling.grammar is not None and plain.sampling.grammar_after == ()


def test_enable_in_reasoning_asks_for_no_gate_and_splits_as_without_it():
    """The router's structured_outputs_enable_in_reasoning (vLLM's enable_in_reasoning):
    every grammar holds from the output's first token, a chat's and a completion's, where
    the gate would have waited for `</think>`; the text is split, and a thinking budget
    kept, as without it (vLLM's front end splits whatever its engine's gate)."""
    import asyncio

    from deployments.openai_api import ChatCompletionRequest, CompletionRequest
    from deployments.reasoning import ThinkTokens, request_split
    from tests.unit.test_thinking_budget import CHAT, demo_reader

    schema = {"type": "json_object"}
    chats = {"chat": {"thinking_token_budget": 4}, "hidden": {"include_reasoning": False},
             "no thinking": {"chat_template_kwargs": {"enable_thinking": False}}}
    reader = demo_reader("qwen3", structured_outputs_enable_in_reasoning=True)
    tags = ThinkTokens.of(reader.tokenizer, "qwen3")
    for name, fields in chats.items():
        body = ChatCompletionRequest(messages=CHAT, response_format=schema, **fields)
        prompt = asyncio.run(reader.read(body, True))
        assert prompt.sampling.grammar is not None, name
        assert (prompt.sampling.grammar_after, prompt.sampling.grammar_at) == ((), ()), name
        plan = SimpleNamespace(choices=[SimpleNamespace(request=SimpleNamespace(
            sampling=prompt.sampling, prompt_token_ids=prompt.token_ids))])
        split = request_split("qwen3", body, plan, tags)
        assert (split is not None) == (name == "chat"), name
        assert request_split("qwen3", body, plan) is None  # without the option's reading
        assert (prompt.sampling.thinking_budget is not None) == (name == "chat"), name
    body = CompletionRequest(prompt="x", response_format=schema)
    assert asyncio.run(reader.read(body, False)).sampling.grammar_after == ()
    assert asyncio.run(demo_reader("qwen3").read(body, False)).sampling.grammar_after == \
        tags.end  # off (the default): unchanged


def test_the_router_frees_the_end_tokens_in_the_reasoning_under_ignore_eos_alone():
    """The prompt reader's Prompt.free_in_reasoning: the end tokens (still stops) under
    ignore_eos with a gated grammar, not one asked for in stop_token_ids; none without
    ignore_eos, without a gate, or without a grammar."""
    import asyncio

    from deployments.openai_api import ChatCompletionRequest
    from tests.unit.test_thinking_budget import CHAT, demo_reader

    reader, schema = demo_reader("qwen3"), {"type": "json_object"}
    eos = reader.tokenizer.eos_token_id

    def read(**fields):
        return asyncio.run(reader.read(ChatCompletionRequest(messages=CHAT, **fields), True))

    freed = read(response_format=schema, ignore_eos=True)
    assert freed.free_in_reasoning == (eos,) and eos in freed.stop_token_ids
    assert read(response_format=schema, ignore_eos=True,
                stop_token_ids=[eos]).free_in_reasoning == ()
    for fields in ({"response_format": schema}, {"ignore_eos": True},
                   {"response_format": schema, "ignore_eos": True, "include_reasoning": False}):
        assert read(**fields).free_in_reasoning == (), fields


def test_the_gate_travels_with_the_sampling_parameters():
    from deployments.wire import sampling_from_proto, sampling_to_proto

    params = SamplingParams(temperature=0, grammar="start: /a/", grammar_after=(7, 8))
    assert sampling_from_proto(sampling_to_proto(params)) == params
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after=(7,))


def test_the_router_takes_gated_scores_only_from_a_verifier_that_says_it_gated(demo):
    """A verifier that predates the gate ignores grammar_after_ids and masks from the
    output's first token, a law other than the request's: each verifier says it gated
    (ScoreResponse.grammar_gated), and the router refuses a gated call's scores without
    it, as it refuses a tree scored as a chain, rather than take them."""
    from deployments import wire
    from deployments.pool_handles import gated
    from protos import specserve_pb2 as pb
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.types import PoolUnavailable, PrefixSync, ScoreCall
    from verifier.host import to_host

    _, target, _, ll, prompt, grammar = demo
    verifier = ModelVerifier(target, grammar_tokenizer=ll)
    calls = {ends: ScoreCall(f"echo{len(ends)}", PrefixSync(0, EMPTY_PREFIX_HASH, tuple(
        prompt)), (), SamplingParams(temperature=0, grammar=grammar, grammar_after=ends),
        prompt_len=len(prompt)) for ends in ((), ENDS["one id"])}
    for ends, call in calls.items():
        [scores] = to_host(verifier.score_batch([call]))
        back = wire.scores_from_proto(pb.ScoreResponse.FromString(
            wire.scores_to_proto(scores).SerializeToString()))
        assert back.grammar_gated == bool(ends)
        assert gated(call, back) is back
    older = wire.scores_from_proto(pb.ScoreResponse(greedy=pb.GreedyScores(
        target_token_ids=[1])))  # an answer without the field
    assert gated(calls[()], older) is older
    with pytest.raises(PoolUnavailable, match="one version"):
        gated(calls[ENDS["one id"]], older)


@pytest.mark.parametrize("before, begun", [(0, 2), (3, 3)])
def test_a_proposal_completes_end_ids_a_short_reasoning_began(demo, before, begun):
    """The n-gram drafter's cut where the end ids (four here) began in a reasoning (shorter
    than they are, or not) and a proposal completes them: the grammar holds on what
    follows, so a token it refuses there is cut (the head's ids were read from a negative
    index: the first of them lost, the end missed and the whole proposal allowed; the
    head's window must hold len(ends) - 1 ids, for a proposal that ends them at its first).
    A forbidden proposal costs speed alone (the verifier's masks reject it)."""
    _, _, _, ll, _, grammar = demo
    ends = (101, 102, 103, 104)
    refused = int((~TokenMasks(ll, grammar).next_mask(1000)).nonzero()[0])
    sampling = SamplingParams(temperature=0, grammar=grammar, grammar_after=ends)
    output = [7] * before + list(ends[:begun])  # a reasoning shorter or longer than they
    matcher = matcher_after(SimpleNamespace(constraint=None), sampling, ll, output)
    assert not matcher.opened
    assert matcher.allowed_prefix([*ends[begun:], refused]) == len(ends) - begun


def test_of_several_implicit_end_ids_the_first_to_stand_ends_the_reasoning():
    """Gate ids (grammar_at) in the order they stand, not the order they are listed: the
    grammar holds from the first that stands in the reasoning (a later one would leave the
    ids between them unconstrained); the end ids whole before both win."""
    after, at = (100, 101), (7, 9)
    assert reasoning_end([5, 9, 6, 7, 8], 0, after, at) == (1, True)
    assert reasoning_end([5, 9, 6, 7, 8], 2, after, at) == (3, True)
    assert reasoning_end([100, 101, 9, 7], 0, after, at) == (2, False)
