"""vLLM's thinking_token_budget: once a thinking section has spent the budget, the end ids
are forced one a step, then the output goes on freely; the router commits them itself,
cutting a round there, so the output is the target's own decode under that forcing
whatever the rounds commit at once; its refusals are 400s naming the field."""

import asyncio
import json

import pytest
import torch

from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from speculative.sampling import SamplingParams
from speculative.state import Request, RequestState
from speculative.thinking import ThinkingBudget
from tests.unit.test_request_fields import request_with

CHAT = [{"role": "user", "content": "hi"}]
MAX_TOKENS = 40


def forced_next(prompt, output, budget: ThinkingBudget) -> int | None:
    """The reference: the id vLLM forces after `output` (None: the model's choice), read
    from the whole sequence again at each step: the sections, each from its start ids (or
    the prompt's unclosed last one, its tokens counted from the start ids' last id unless
    they spent the budget) to its first end ids or its forced ones; end ids in the output
    before a section's start (since the last close) leave it no natural close."""
    start, end, limit = list(budget.start), list(budget.end), budget.budget

    def at(ids, i, part):
        return i >= len(part) - 1 and ids[i - len(part) + 1:i + 1] == part

    starts = [i for i in range(len(prompt)) if at(prompt, i, start)]
    ends = [i for i in range(len(prompt)) if at(prompt, i, end)]
    inside = bool(starts) and (not ends or starts[-1] > ends[-1])
    count = len(prompt) - 1 - starts[-1] if inside else 0
    if inside and count < limit:  # vLLM's: from the start ids' last id
        count -= len(start) - 1
    forcing, seen_end, since = None, False, []
    for token in output:
        if forcing is None and inside and count >= limit:
            forcing = 0
        if forcing is not None:
            assert token == end[forcing], "the decode took the forced id"
            forcing += 1
            if forcing == len(end):
                forcing, inside, count, seen_end, since = None, False, 0, False, []
            continue
        since.append(token)
        if inside and not seen_end and at(since, len(since) - 1, end):
            inside, count, since = False, 0, []
        elif inside:
            count += 1
        elif at(since, len(since) - 1, start):
            inside, count = True, 0
        elif at(since, len(since) - 1, end):
            seen_end = True
    if forcing is None and inside and count >= limit:
        forcing = 0
    return None if forcing is None else end[forcing]


def forced_greedy(model, prompt, budget: ThinkingBudget, max_tokens: int) -> list[int]:
    """The target's plain greedy decode, token by token, under vLLM's forcing."""
    output = []
    with torch.no_grad():
        while len(output) < max_tokens:
            forced = forced_next(prompt, output, budget)
            if forced is None:
                logits = model(torch.tensor([prompt + output])).logits[0, -1]
                forced = int(logits.argmax())
            output.append(forced)
    return output


def committed_by_rounds(prompt, rounds, budget, max_tokens=MAX_TOKENS, stop=()):
    """The commits of rounds of the model's ids (each a plain decode's next ids, whatever
    the forced ones did: a round's ids past a forced one are dropped)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, thinking_budget=budget)
    state = RequestState(Request("r", tuple(prompt), params, tuple(stop)))
    for ids in rounds:
        state.commit(tuple(ids))
        if state.finish_reason is not None:
            break
    return state


def test_a_round_is_cut_where_the_budget_runs_out_and_the_end_ids_go_in():
    """The prompt opens the section (<think> = 1, then 2 tokens of it): budget 4 leaves 2
    for the output; a round of 5 ids keeps 2, then the end ids (8, 9) one a position, and
    the next round goes on after them."""
    budget = ThinkingBudget(4, (1,), (8, 9))
    state = committed_by_rounds([5, 1, 3, 3], [(4, 4, 4, 4, 4), (6, 7)], budget)
    assert state.output_token_ids == [4, 4, 8, 9, 6, 7]
    assert state.round_kept == 2 and state.finish_reason is None


def test_the_end_ids_follow_a_round_that_ends_at_the_budget_and_count_against_max_tokens():
    budget = ThinkingBudget(2, (1,), (8, 9))
    state = committed_by_rounds([1], [(4, 4)], budget)
    assert state.output_token_ids == [4, 4, 8, 9] and state.round_kept == 2
    short = committed_by_rounds([1], [(4, 4)], budget, max_tokens=3)
    assert short.output_token_ids == [4, 4, 8] and short.finish_reason == "length"
    stopped = committed_by_rounds([1], [(4, 4)], budget, stop=(8,))
    assert stopped.output_token_ids == [4, 4, 8] and stopped.finish_reason == "stop"


def test_sections_the_output_opens_and_closes_itself():
    """A section the output opens is budgeted from its start ids; one it closes itself
    needs no forcing; after a forced close a new section gets the whole budget again."""
    budget = ThinkingBudget(1, (1,), (8,))
    state = committed_by_rounds([5], [(3, 1, 4, 8, 3, 1, 4, 4, 4, 1, 2, 2)], budget)
    # 1 4 8: closed by the model; 1 4 (8 forced) 4 4; 1 2 (8 forced)
    assert state.output_token_ids == [3, 1, 4, 8, 3, 1, 4, 8]
    state.commit((4, 1, 2, 2))
    assert state.output_token_ids == [3, 1, 4, 8, 3, 1, 4, 8, 4, 1, 2, 8]


def test_end_ids_before_a_section_leave_it_to_the_forced_close_as_vllms_state():
    budget = ThinkingBudget(3, (1,), (8,))
    state = committed_by_rounds([5], [(8, 1, 8, 4, 4, 4)], budget)
    assert state.output_token_ids == [8, 1, 8, 4, 4, 8]


def test_a_budget_the_prompt_spent_forces_the_first_ids():
    budget = ThinkingBudget(0, (1,), (8, 9))
    state = committed_by_rounds([1], [(4, 4, 4)], budget)
    assert state.output_token_ids == [8, 9] and state.round_kept == 0
    state.commit((4, 4))
    assert state.output_token_ids == [8, 9, 4, 4]


@pytest.mark.parametrize("prompt, budget, start, end, expected", [
    ([5, 1, 2], 2, (1, 2), (8,), [4, 4, 4, 8, 4, 4, 4, 4]),
    ([1, 2, 3], 3, (1, 2), (8,), [4, 4, 4, 8, 4, 4, 4, 4]),
    ([0, 1, 2, 3], 2, (1, 2, 3), (8, 9), [4, 4, 4, 4, 8, 9, 4, 4]),
    ([1, 2, 3, 3], 2, (1, 2, 3), (8, 9), [4, 4, 4, 8, 9, 4, 4, 4]),
    ([1, 2, 3], 1, (1, 2), (8, 9), [8, 9, 4, 4, 4, 4, 4, 4])])
def test_a_prompts_section_of_several_start_ids_is_counted_as_vllm_counts_it(
        prompt, budget, start, end, expected):
    """vLLM (ThinkingBudgetStateHolder, its outputs here) counts a section the prompt
    opened from its start ids' last id: len(start) - 1 tokens more of the model's before
    the forced ids, unless the prompt spent the budget (then they come first)."""
    think = ThinkingBudget(budget, start, end)
    state = committed_by_rounds(prompt, [(4,) * 8] * 2, think, max_tokens=8)
    assert state.output_token_ids == expected
    assert expected == [forced_next(prompt, expected[:n], think) or 4 for n in range(8)]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("end", [(11,), (11, 12)], ids=["one-end-id", "two-end-ids"])
def test_a_tiny_targets_greedy_output_is_its_own_decode_under_the_forcing(pipelined, end):
    """The oracle: a tiny random target drafted for by a noisy copy; K = 0, 4 and auto
    give the target's own token-by-token greedy decode that forces the end ids at the
    budget: prompts that open the section, and ones whose output opens it (the start id
    chosen among its plain greedy output's)."""
    from drafter.model import ModelDrafter
    from tests.tiny import hf_greedy, noisy_copy, run, tiny_llama
    from verifier.engine import ModelVerifier

    target, forced = tiny_llama(7), 0
    for i, prompt in enumerate([[1], [5, 6, 7, 5, 6], [9, 3, 27, 40]]):
        plain = hf_greedy(target, prompt, MAX_TOKENS)
        for start, budget in (((prompt[-1],), 5), ((plain[3],), 2), ((plain[3],), 0)):
            think = ThinkingBudget(budget, start, end)
            expected = forced_greedy(target, prompt, think, MAX_TOKENS)
            forced += expected != plain
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                    thinking_budget=think)
            for k in (0, 4, "auto"):
                drafter = ModelDrafter(noisy_copy(target, 0.01, seed=1))
                verifier = ModelVerifier(target)
                out, _ = run(drafter, verifier, prompt, params, k, request_id=f"r{i}",
                             pipelined=pipelined)
                assert out == expected, f"prompt {i}, start {start}, budget {budget}, K={k}"
                assert len(verifier.sessions) == 0
    assert forced >= 6  # the budget changed most outputs


def test_a_call_of_several_steps_cut_by_the_budget_keeps_the_verifiers_cache_in_step():
    """K = 0 rounds of 4 plain steps: the verifier fed the steps past the budget, which the
    commit dropped; the router confirms only those it kept, so the next call rolls them
    back without a miss, and the output is the forced decode's."""
    from drafter.model import ModelDrafter
    from tests.tiny import run, tiny_llama
    from verifier.engine import ModelVerifier

    target, prompt = tiny_llama(7), [9, 3, 27, 40]
    think = ThinkingBudget(3, (40,), (11, 12))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, thinking_budget=think)
    out, state = run(ModelDrafter(target), ModelVerifier(target), prompt, params, 0,
                     plain_steps=4)
    assert out == forced_greedy(target, prompt, think, MAX_TOKENS)
    assert state.stats.plain_step_tokens > 0 and state.stats.cache_misses == 0


def parsed(schema, **fields):
    body = json.dumps({"prompt": "x", "messages": CHAT, **fields}).encode()
    return asyncio.run(parse(request_with(body), schema, 1 << 20))


@pytest.mark.parametrize("value", [-2, 2.0, True, "3", [1]])
@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_vllms_refusals_of_the_value_are_400s_naming_the_field(schema, value):
    with pytest.raises(BadRequest, match="must be a non-negative integer or -1") as refused:
        parsed(schema, thinking_token_budget=value)
    assert refused.value.param == "thinking_token_budget"


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_minus_one_and_null_are_no_budget_as_vllms(schema):
    for value in (-1, None):
        assert parsed(schema, thinking_token_budget=value).thinking_token_budget is None
    assert parsed(schema, thinking_token_budget=0).thinking_token_budget == 0


@pytest.mark.parametrize("schema, logprobs", [
    (CompletionRequest, {"logprobs": 0}), (ChatCompletionRequest, {"logprobs": True}),
    (CompletionRequest, {"logprobs": 1, "logprob_token_ids": [3]})])
def test_logprobs_with_a_budget_are_a_400_naming_it(schema, logprobs):
    """vLLM's logprobs of a forced id are the model's own, before the forcing: the router
    commits those ids without a call, so it refuses rather than answer others."""
    with pytest.raises(BadRequest, match="not served with logprobs") as refused:
        parsed(schema, thinking_token_budget=4, **logprobs)
    assert refused.value.param == "thinking_token_budget"
    assert parsed(schema, **logprobs).thinking_token_budget is None


def demo_reader(parser=None, **args):
    from deployments.prompts import PromptReader
    from deployments.router_args import RouterArgs
    from engine.checkpoint import Checkpoint
    from engine.models import load_tokenizer

    model = "models/demo/target"
    return PromptReader(RouterArgs(model=model, reasoning_parser=parser, **args),
                        load_tokenizer(model), Checkpoint.load(model))


def test_the_budget_takes_the_reasoning_parsers_ids_and_without_one_is_vllms_400():
    from deployments.reasoning import ThinkTokens

    reader = demo_reader("qwen3")
    think = ThinkTokens.of(reader.tokenizer)
    for body in (CompletionRequest(prompt="x", thinking_token_budget=3),
                 ChatCompletionRequest(messages=CHAT, thinking_token_budget=3)):
        chat = isinstance(body, ChatCompletionRequest)
        sampling = asyncio.run(reader.read(body, chat)).sampling
        assert sampling.thinking_budget == ThinkingBudget(3, think.start, think.end)
        with pytest.raises(BadRequest, match="reasoning_config is not configured") as refused:
            asyncio.run(demo_reader().read(body, chat))
        assert refused.value.param == "thinking_token_budget"
    # a grammar after the reasoning leaves the budget its section; one from the output's
    # first token (include_reasoning false: vLLM's reasoning_ended) leaves none
    # (deployments.reasoning.grammar_gate)
    constrained = ChatCompletionRequest(messages=CHAT, thinking_token_budget=3,
                                        response_format={"type": "json_object"})
    sampling = asyncio.run(reader.read(constrained, True)).sampling
    assert sampling.grammar_after == think.end
    assert sampling.thinking_budget == ThinkingBudget(3, think.start, think.end)
    hidden = constrained.model_copy(update={"include_reasoning": False})
    sampling = asyncio.run(reader.read(hidden, True)).sampling
    assert sampling.grammar_after == () and sampling.thinking_budget is None


def test_a_messages_enabled_thinking_is_the_budget_whatever_the_parser():
    """vLLM 0.32's anthropic serving sets the chat's thinking_token_budget from an enabled
    thinking's budget_tokens (its engine then refuses it without a reasoning config: the
    Messages route's test below); adaptive pins nothing."""
    from deployments.messages_api import MessagesRequest

    asked = parsed(MessagesRequest, model="m", max_tokens=4000, messages=CHAT,
                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert asked.chat_request()[0].thinking_token_budget == 1024
    off = parsed(MessagesRequest, model="m", max_tokens=4000, messages=CHAT,
                 thinking={"type": "adaptive"})
    assert off.chat_request()[0].thinking_token_budget is None


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_sampled_outputs_take_the_forced_ids_at_the_budget_and_repeat_by_seed(k, pipelined):
    """Seeded sampling, K = 0 and 4 (whose outputs differ, as without a budget: rounds draw
    differently): every position where the reference forces an id holds it, every section
    ends within its budget, and a seed gives the same output again."""
    from drafter.model import ModelDrafter
    from tests.tiny import noisy_copy, run, tiny_llama
    from verifier.engine import ModelVerifier

    target, prompt, forced = tiny_llama(7), [9, 3, 27, 40], 0
    think = ThinkingBudget(3, (40,), (11, 12))
    for seed in range(4):
        params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed,
                                thinking_budget=think)
        outs = [run(ModelDrafter(noisy_copy(target, 0.01, seed=1)), ModelVerifier(target),
                    prompt, params, k, pipelined=pipelined)[0] for _ in range(2)]
        assert outs[0] == outs[1] and len(outs[0]) == MAX_TOKENS
        for n in range(MAX_TOKENS):
            expected = forced_next(prompt, outs[0][:n], think)
            forced += expected is not None
            assert expected is None or outs[0][n] == expected, f"seed {seed}, position {n}"
    assert forced >= 8  # each output's prompt-opened section was forced shut


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_a_messages_request_reaches_the_chat_with_its_budget_refused_without_a_parser(parser):
    """Through the router's Messages route: the chat it plans carries budget_tokens as its
    thinking_token_budget, which the prompt's reading refuses without a reasoning parser,
    vLLM 0.32's 400 in Anthropic's error shape."""
    from deployments.reasoning import NO_REASONING_CONFIG
    from tests.unit.test_messages_api import messages_router, posted_to

    router, planned = messages_router(parser=parser), []
    plan, reader = router.plan, demo_reader(parser)

    async def recorded(body, chat):  # the stand-in's plan, after the prompt's own reading
        planned.append(body.thinking_token_budget)
        await reader.read(body, chat)
        return await plan(body, chat)

    router.plan = recorded
    status, answer = posted_to(router, {"model": "m", "max_tokens": 2000, "messages": CHAT,
                                        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert planned == [1024]
    if parser is None:
        assert status == 400 and answer["type"] == "error"
        assert answer["error"] == {"type": "invalid_request_error",
                                   "message": NO_REASONING_CONFIG}
    else:
        assert status == 200
