"""What a client reads of one request, pinned where a small slip (a mutant) went unseen by
the other tests: the `speculative` block's and vLLM's per-request metrics on rounds without
a draft, the text of held bytes and peeked tokens, max_tokens 0, and a batch's choices'
indices, prompts, usage and stop reasons."""

import asyncio
import json

import pytest

from deployments.admission import Admission
from deployments.choices import Choices
from speculative.driver import Detokenizer, Generation
from speculative.fixed_k import FixedK
from speculative.frontend import RequestFrontEnd, joined
from speculative.rejection import RoundOutcome
from speculative.sampling import SamplingParams
from speculative.state import Request
from speculative.stats import SpecStats
from tests.tiny import Agreeing, Scripted
from tests.unit.test_router_parts import Recorded


def test_mean_acceptance_length_leaves_out_the_plain_steps_of_a_round():
    """A round without a draft that asked for 4 plain steps outputs 4 tokens, 3 of them its
    later steps (plain_step_tokens, as loop.py counts them): speculation's mean acceptance
    length is 1 there, not 4 (the CLI's tokens a round is the other count)."""
    stats = SpecStats()
    stats.record(0, RoundOutcome((5, 6, 7, 8), 0))
    stats.plain_step_tokens += 3
    stats.record(2, RoundOutcome((1, 2, 3), 2))
    assert stats.as_dict()["mean_acceptance_length"] == (1 + 3) / 2
    assert stats.as_dict()["num_emitted_tokens"] == 7


def test_vllms_metrics_of_a_request_that_never_drafted():
    """No round drafted (K 0, or every draft failed): no speculation step, a histogram of
    its one bucket empty, and a mean acceptance length of 1 (each step's one token), not 0."""
    stats = SpecStats()
    stats.record(0, RoundOutcome((5,), 0))
    stats.record(0, RoundOutcome((6,), 0))
    assert stats.vllm_metrics() == {"speculative_decoding": {
        "mean_acceptance_length": 1.0, "draft_acceptance_rate": 0.0,
        "acceptance_histogram": [0], "num_spec_steps": 0, "num_accepted_draft_tokens": 0,
        "num_draft_tokens": 0, "num_spec_tokens": 0}}


def test_mean_num_speculative_tokens_counts_every_round():
    """Tokens drafted per round, over every round: a round without a draft (a fallback, an
    adaptive K of 0) lowers the mean K, 4 and 0 making 2 (over the rounds that drafted: 4)."""
    stats = SpecStats()
    stats.record(4, RoundOutcome((1, 2), 1))
    stats.record(0, RoundOutcome((5,), 0))
    assert stats.as_dict()["mean_num_speculative_tokens"] == 2.0


def byte_decode(ids):
    """Each id a byte (0-255): a character's bytes may span ids, as under byte-level BPE."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_a_settled_output_that_ends_inside_a_character_keeps_its_last_bytes():
    """A beam search's output settled whole: its text is its ids' text, an incomplete
    character at the end read as U+FFFD (as the decode of its ids, and as stream() flushes
    it), not dropped."""
    params = SamplingParams(temperature=0, max_tokens=2)
    generation = Generation(Request("r", (ord("x"),), params), byte_decode)
    generation.settle([ord("a"), 0xE2], [], "length", None, shown=2)
    assert generation.text == "a\ufffd" == byte_decode([ord("a"), 0xE2])


# token id -> its bytes: a token may end inside a character, or hold bytes that form none
PIECES = {0: b"x", 1: b"a\xe2", 2: b"\x82\xac", 3: b"\x80a\x80"}


def pieces_decode(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_a_peek_at_a_token_that_completes_a_character_leaves_the_text_as_it_was():
    """A logprob's top token peeked at (deployments.logprobs) where the text so far ends in
    an incomplete character, some of the held token's text already out ("a"): the chosen
    token's text after it is the character alone, "a" not sent twice."""
    detokenizer = Detokenizer(pieces_decode, (0,))
    assert detokenizer.add(1) == "a"
    assert detokenizer.peek(2) == "\u20ac"
    assert detokenizer.add(2) == "\u20ac"


def test_held_bytes_that_never_form_a_character_go_out_once():
    """Tokens whose text keeps ending in bytes that form no character ("\ufffda\ufffd"
    each) are held up to MAX_HELD_TOKENS, then cut: the text that went out before a cut is
    not sent again after it; the deltas join into the ids' text."""
    detokenizer, ids = Detokenizer(pieces_decode, (0,)), [3] * 12
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
    assert text == pieces_decode(ids)


class NoPool:
    """A drafter and verifier that no call may reach."""

    async def propose(self, call):
        raise AssertionError("the drafter was called")

    async def score(self, call):
        raise AssertionError("the verifier was called")

    async def release(self, request_id):
        pass


def test_max_tokens_0_ends_at_length_before_any_round():
    """max_tokens 0 (a completions echo of the prompt alone): ended at length before a
    round, no pool called, no text, no ids, no round counted."""
    params = SamplingParams(temperature=0, max_tokens=0)
    generation = Generation(Request("r", (0,), params), pieces_decode)
    assert generation.finish_reason == "length"
    asyncio.run(generation.run(NoPool(), NoPool(), FixedK(3)))
    assert (generation.text, generation.token_ids, generation.finish_reason) == \
        ("", [], "length")
    assert generation.stats.rounds == 0


def batch_choices(**options) -> Choices:
    """A completions batch of two prompts of different lengths, n=2 each (vLLM's choice
    indices: the first prompt's two choices, then the second's)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    front_end = RequestFrontEnd()
    plan = joined("cmpl-x", [front_end.plan(f"cmpl-x-{i}", prompt, greedy, n=2)
                             for i, prompt in enumerate([(2, 3), (4, 5, 6)])])
    engine = Agreeing()
    return Choices(plan, (engine, engine), lambda ids: "a" * len(ids), Recorded(),
                   Admission(4).admit(4), model="m", chat=False, **options)


def test_a_batchs_whole_answer_numbers_its_choices_with_their_own_prompts():
    """Each choice's index is its place (0..3, not all 0: a client matches choices by it)
    and its prompt_token_ids are its own prompt's (the second prompt's for choices 2, 3)."""
    body = asyncio.run(batch_choices(return_token_ids=True).complete())
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == \
        [[2, 3], [2, 3], [4, 5, 6], [4, 5, 6]]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


def test_continuous_usage_counts_each_choices_own_prompt():
    """Streamed with continuous usage, a chunk's usage counts its choice's prompt: 2 tokens
    for the first prompt's choices, 3 for the second's."""
    async def collect():
        choices = batch_choices(return_token_ids=False, continuous_usage=True)
        return [e async for e in choices.events()]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(collect())[:-1]]
    prompts = {(c["choices"][0]["index"], c["usage"]["prompt_tokens"]) for c in chunks}
    assert prompts == {(0, 2), (1, 2), (2, 3), (3, 3)}


@pytest.mark.parametrize("end, stop_reason", [(7, 7), (9, None)])
def test_a_choice_names_the_stop_id_it_asked_for_and_not_the_models_end(end, stop_reason):
    """As vLLM: stop_reason is the request's own stop token id that ended the choice (7),
    None at the model's end token (9, a stop id the request did not name), in the whole
    answer and on the streamed choice's last chunk."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    plan = RequestFrontEnd().plan("cmpl-s", (0,), greedy, n=1, stop_token_ids=(7, 9))

    def choices():
        engine = Scripted([1, 2, end, 3], miss=2, prompt_len=1)
        return Choices(plan, (engine, engine), lambda ids: "a" * len(ids), Recorded(),
                       Admission(4).admit(1), model="m", chat=False,
                       return_token_ids=True, stop_token_ids=(7,))

    async def collect():
        return [e async for e in choices().events()]

    whole = asyncio.run(choices().complete())["choices"][0]
    assert (whole["token_ids"], whole["finish_reason"], whole["stop_reason"]) == \
        ([1, 2, end], "stop", stop_reason)
    last = json.loads(asyncio.run(collect())[-2][len("data: "):])["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_reason)
