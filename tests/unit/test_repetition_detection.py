"""vLLM's repetition_detection: the output ends at the first token whose output tail is a
pattern repeated min_count times, as vLLM's scheduler ends it token by token, whatever the
rounds commit at once; its refusals are 400s naming the field."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.beams import refuse_unsearched
from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.tools import FieldError
from speculative.driver import Generation
from speculative.policy import k_policy
from speculative.repetition import RepetitionDetection
from speculative.sampling import SamplingParams
from speculative.state import Request
from tests.tiny import Scripted
from tests.unit.test_request_fields import request_with

ALPHABET = "abc"
END = 2  # the stop id of the cases that have one
CHAT = [{"role": "user", "content": "hi"}]


def decode(ids):
    return "".join(ALPHABET[i] for i in ids)


def periodic_tail(output, size, count):
    """vLLM's definition, position by position: each of the last `size` ids equals the ids
    size, 2 x size, ... (count - 1) x size before it."""
    return all(output[-n] == output[-(size * m + n)]
               for n in range(1, size + 1) for m in range(1, count))


def reference(output, detect, min_tokens=0, max_tokens=None, stop_ids=()):
    """(ids, finish_reason, stop_reason) as vLLM's check_stop ends a plain decode of
    `output`: after each token, its stop ids, then the length, then (from min_tokens on)
    a pattern of each size from the smallest until size x min_count passes the output."""
    max_tokens = max_tokens or len(output)
    for n in range(1, max_tokens + 1):
        ids = output[:n]
        if ids[-1] in stop_ids:
            return ids, "stop", ids[-1]  # a stop id (an EOS, unreported: None)
        if n == max_tokens:
            return ids, "length", None
        if n < min_tokens:
            continue
        for size in range(max(detect.min_pattern_size, 1), detect.max_pattern_size + 1):
            if size * detect.min_count > n:
                break
            if periodic_tail(ids, size, detect.min_count):
                return ids, "repetition", "repetition_detected"
    raise AssertionError("max_tokens ends every output")


def generate(output, detect, k, min_tokens=0, stop=(), stop_ids=(), miss=3, decode=decode):
    params = SamplingParams(temperature=0, max_tokens=len(output), stop=stop,
                            min_tokens=min_tokens, repetition_detection=detect)
    generation = Generation(Request("r", (0,), params, tuple(stop_ids)), decode)
    engine = Scripted(output, miss, 1)
    policy = k_policy(k, pipelined=False, greedy=True)

    async def collect():
        return [d async for d in generation.stream(engine, engine, policy)]

    return generation, asyncio.run(collect())


detections = st.builds(lambda low, extra, count: RepetitionDetection(low + extra, low, count),
                       st.integers(0, 4), st.integers(0, 3), st.integers(2, 4)).filter(
    lambda d: d.max_pattern_size > 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), detections,
       st.sampled_from([0, 1, 4, "auto"]), st.integers(0, 6), st.booleans(),
       st.integers(2, 4))
def test_an_output_ends_where_vllms_token_by_token_check_ends_it(output, detect, k,
                                                                 min_tokens, stop_id, miss):
    """Greedy output with K = 0, 1, 4 and auto (rounds committing up to K + 1 ids): the
    ids, the finish and stop reasons and the text are vLLM's plain decode's; the streamed
    deltas are the text."""
    stop_ids = (END,) if stop_id else ()
    generation, deltas = generate(output, detect, k, min_tokens, stop_ids=stop_ids, miss=miss)
    ids, finish, stop_reason = reference(output, detect, min_tokens, stop_ids=stop_ids)
    assert (generation.token_ids, generation.finish_reason) == (ids, finish)
    assert generation.stop_reason == stop_reason
    text = decode(ids[:-1] if finish == "stop" else ids)  # a stop id's text is left out
    assert generation.text == text and "".join(deltas) == text


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), detections, st.integers(0, 5))
def test_the_check_reads_the_output_alone_as_vllms_definition(output, detect, prompt_len):
    """repeats() over the committed ids (a prompt before the output) is vLLM's check of the
    output alone, whatever the prompt repeats."""
    committed = [output[0]] * prompt_len + output
    smallest = max(detect.min_pattern_size, 1)
    expected = any(periodic_tail(output, size, detect.min_count)
                   for size in range(smallest, detect.max_pattern_size + 1)
                   if size * detect.min_count <= len(output))
    assert detect.repeats(committed, len(output)) == expected


def test_a_pattern_that_completes_inside_a_round_cuts_the_round_there():
    """abcabc...: with min_count 2 and K = 8 a round commits past the second "abc"; the
    output is cut where it completes (6 ids), as vLLM's scheduler trims a step's ids."""
    output = [0, 1, 2] * 5
    generation, deltas = generate(output, RepetitionDetection(3, 3, 2), 8, miss=99)
    assert generation.token_ids == output[:6] and generation.text == "abcabc"
    assert (generation.finish_reason, generation.stop_reason) == ("repetition",
                                                                  "repetition_detected")
    assert generation.stats.num_emitted_tokens == 10  # a first id, then a round of 9, cut


def test_the_length_and_a_stop_string_at_the_same_token_win_as_in_vllm():
    """At max_tokens the output ends for its length (vLLM checks it first); a stop string
    that completes at the same token ends it for that string (vLLM's detokenizer finds it
    in the step's ids after the scheduler ended them)."""
    at_length, _ = generate([0, 0], RepetitionDetection(1, 1, 2), 4)
    assert (at_length.finish_reason, at_length.stop_reason) == ("length", None)
    stopped, _ = generate([1, 0, 0, 1], RepetitionDetection(1, 1, 2), 4, stop=("aa",))
    assert (stopped.token_ids, stopped.text) == ([1, 0, 0], "b")
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "aa")


def test_a_stop_string_named_as_vllms_stop_reason_leaves_the_text_whole():
    """The bytes the detokenizer held (id 1: a byte that forms no character, U+FFFD) are
    written out at a repetition, even where a stop string reads "repetition_detected" (it
    did not end the text)."""
    def lone_bytes(ids):
        return "".join("\ufffd" if i == 1 else ALPHABET[i] for i in ids)

    generation, deltas = generate([0, 1, 1, 0], RepetitionDetection(1, 1, 2), 0,
                                  stop=("repetition_detected",), decode=lone_bytes)
    assert generation.finish_reason == "repetition"
    assert generation.text == "a\ufffd\ufffd" and "".join(deltas) == generation.text


@pytest.mark.parametrize("detection, message", [
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": -1}, "max_pattern_size, min_pattern_size must be >=0"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
     "with min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": 1025, "min_count": 2}, "at most 1024")])
@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_vllms_refusals_are_400s_naming_the_field(schema, detection, message):
    body = json.dumps({"prompt": "x", "messages": CHAT,
                       "repetition_detection": detection}).encode()
    with pytest.raises(BadRequest, match=message) as refused:
        asyncio.run(parse(request_with(body), schema, 1 << 20))
    assert refused.value.param.startswith("repetition_detection")


def test_the_field_reaches_the_sampling_parameters_as_vllm_takes_it():
    """Unknown keys ignored and min_pattern_size 0 as vLLM's; max_pattern_size 0 is off
    (min_count then unread), and is no field a beam search refuses."""
    asked = CompletionRequest(prompt="x", repetition_detection={
        "max_pattern_size": 4, "min_count": 3, "other": 1})
    assert asked.sampling(16).repetition_detection == RepetitionDetection(4, 0, 3)
    for off in ({}, {"max_pattern_size": 0, "min_count": 1}, None):
        body = ChatCompletionRequest(messages=CHAT, repetition_detection=off,
                                     use_beam_search=True)
        assert body.sampling(16).repetition_detection is None
        refuse_unsearched(body, chat=True)
    beams = ChatCompletionRequest(messages=CHAT, use_beam_search=True,
                                  repetition_detection={"max_pattern_size": 2, "min_count": 2})
    with pytest.raises(FieldError, match="beam search") as refused:
        refuse_unsearched(beams, chat=True)
    assert refused.value.param == "repetition_detection"


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_a_tiny_targets_greedy_output_ends_where_its_own_decode_would(pipelined):
    """The oracle with repetition_detection: a tiny random target (whose greedy output
    repeats soon) drafted for by a noisy copy; K = 0, 4 and auto end each prompt's output
    where vLLM's check ends the target's own greedy decode, at the same ids."""
    from drafter.model import ModelDrafter
    from tests.tiny import hf_greedy, noisy_copy, run, tiny_llama
    from verifier.engine import ModelVerifier

    target = tiny_llama(7)
    detect, ended = RepetitionDetection(6, 2, 2), 0
    params = SamplingParams(temperature=0, max_tokens=40, repetition_detection=detect)
    for i, prompt in enumerate([[1], [5, 6, 7, 5, 6], [9, 3, 27, 40]]):
        expected = reference(hf_greedy(target, prompt, 40), detect)
        ended += expected[1] == "repetition"
        for k in (0, 4, "auto"):
            drafter = ModelDrafter(noisy_copy(target, 0.01, seed=1))
            out, state = run(drafter, ModelVerifier(target), prompt, params, k,
                             request_id=f"r{i}", pipelined=pipelined)
            assert (out, state.finish_reason) == expected[:2], f"prompt {i}, K={k}"
    assert ended > 0  # some output repeated (a case that ends no output proves little)
