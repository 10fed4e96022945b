"""What the reasoning's gate costs the router's loop. Its commit of an end token that ends
nothing inside a gated grammar's reasoning (Request.free_in_reasoning,
RequestState._reasoning_at): read as the masks read the gate
(speculative.token_masks.reasoning_end on the output's ids), at a cost linear in the output
however many such tokens it holds; and a chat's split under
structured_outputs_enable_in_reasoning (deployments.reasoning.request_split), its prompt's
gate read once however many choices share it."""

import random
from types import SimpleNamespace

import deployments.reasoning
import speculative.state
from deployments.reasoning import ReasoningSplit, ThinkTokens, request_split
from speculative.sampling import SamplingParams
from speculative.state import Request, RequestState
from speculative.token_masks import reasoning_end

EOS, AFTER, AT = 2, (3, 4), (5,)


def state(prompt: tuple[int, ...], at: tuple[int, ...] = AT, max_tokens: int = 64):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, grammar="start: /a/",
                            grammar_after=AFTER, grammar_at=at)
    return RequestState(Request("r", prompt, params, (EOS,), free_in_reasoning=(EOS,)))


def expected(output: list[int], at: tuple[int, ...]) -> tuple[list[int], str]:
    """The output cut at its first end token after the reasoning's end (the whole output
    read again at each), and its finish_reason."""
    for i, token in enumerate(output):
        if token == EOS and reasoning_end(output[:i], 0, AFTER, at)[0] is not None:
            return output[:i + 1], "stop"
    return output, "length"


def test_an_end_token_ends_the_output_only_after_the_reasoning_however_rounds_cut_it():
    """Rounds of any length, the end ids straddling them (and the prompt's end, which ends
    nothing: the masks read the output alone), an implicit end or none."""
    rng = random.Random(0)
    for case in range(400):
        at = AT if case % 2 else ()
        output = [rng.choice((1, EOS, 3, 4, 5, 6)) for _ in range(48)]
        current = state((7, 3), at, len(output))  # a prompt ending with the end ids' first
        while current.finish_reason is None:
            current.commit(tuple(output[current.num_output_tokens:][:rng.randint(1, 5)]))
        assert (current.output_token_ids, current.finish_reason) == expected(output, at), \
            (case, output)


def test_many_end_tokens_in_the_reasoning_are_read_once(monkeypatch):
    """An output of end tokens alone under ignore_eos (a model that keeps writing them): each
    commit reads the ids committed since the last, not the whole output again (32k of them
    took 10 s of the router's event loop read whole at each)."""
    read = []

    def counted(ids, *args):
        read.append(len(ids))
        return reasoning_end(ids, *args)

    monkeypatch.setattr(speculative.state, "reasoning_end", counted)
    current = state((7,), max_tokens=2000)
    while current.finish_reason is None:
        current.commit((EOS,))
    assert current.finish_reason == "length" and current.num_output_tokens == 2000
    assert sum(read) <= 2 * 2000


def test_the_split_under_enable_in_reasoning_reads_a_prompts_gate_once(monkeypatch):
    """The n choices of a chat share its prompt's ids: its gate (grammar_gate, a scan of
    the prompt) is read once for them all, not once a choice."""
    from deployments.openai_api import ChatCompletionRequest

    calls = []

    def counted(*args):
        calls.append(args)
        return gate(*args)

    gate = deployments.reasoning.grammar_gate
    monkeypatch.setattr(deployments.reasoning, "grammar_gate", counted)
    tags = ThinkTokens(start=(8,), end=(9,))
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=8,
                                 response_format={"type": "json_object"})
    prompt = (7,) * 1000
    sampling = SamplingParams(temperature=1.0, max_tokens=4, grammar="start: /a/")
    plan = SimpleNamespace(choices=[SimpleNamespace(request=SimpleNamespace(
        sampling=sampling, prompt_token_ids=prompt)) for _ in range(8)])
    assert request_split("deepseek_r1", body, plan, tags) == ReasoningSplit("deepseek_r1")
    assert len(calls) == 1
