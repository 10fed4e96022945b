"""logit_bias and min_tokens: the request's shaping of the logits, exact under speculation.

`shape_logits` follows the definitions row by row (OpenAI's bias added to the raw logits;
vLLM's min_tokens masking the end ids while the output, drafted tokens included, is short),
greedy output under each equals a plain reference loop and the target alone, the request
fields are read and refused as OpenAI's and vLLM's are, and the wire carries them.
"""

import pytest
import torch
from pydantic import ValidationError

from deployments import wire
from deployments.admission import Admission
from deployments.ingress import BadRequest
from deployments.openai_api import CompletionRequest
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.sampling import SamplingParams
from speculative.shaping import Shaping, shape_batch, shape_logits
from tests.tiny import noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

BIAS = ((3, 4.0), (7, -100.0))


def test_the_bias_is_added_and_min_tokens_masks_the_short_rows():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(logit_bias=BIAS, min_tokens=3, min_tokens_end_ids=(2, 5))
    rows = shape_logits(logits, params, [1, 1], [4], [9, 8, 6])  # output lengths 1, 2, 3, 4
    expected = logits.clone()
    expected[:, 3] += 4.0
    expected[:, 7] -= 100.0
    expected[:2, [2, 5]] = float("-inf")
    torch.testing.assert_close(rows, expected)


def test_min_tokens_yields_to_a_row_that_allows_only_an_end():
    """A grammar that allows only an end (the rest -inf) keeps it: the row is not emptied."""
    logits = torch.full((2, 8), float("-inf"))
    logits[:, 2] = 0.0
    logits[1, 4] = 1.0
    params = SamplingParams(min_tokens=5, min_tokens_end_ids=(2,))
    rows = shape_logits(logits, params, [1], [], [4])
    assert rows[0, 2] == 0 and rows[1, 2] == float("-inf") and rows[1, 4] == 1


def test_min_tokens_masks_an_end_id_in_the_last_column_and_skips_one_past_it():
    """The vocabulary's last id may be an end id (a special token added last): masked like
    any other, from min_tokens 1 on (the first token); an end id past the logits' columns (a
    padded vocabulary's) is left out."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(min_tokens=1, min_tokens_end_ids=(7, 8))
    rows = shape_logits(logits, params, [1], [], [4])  # output lengths 0, 1
    expected = logits.clone()
    expected[0, 7] = float("-inf")
    torch.testing.assert_close(rows, expected)


def test_nothing_to_shape_leaves_the_logits_alone_and_a_foreign_id_is_refused():
    logits = torch.randn(2, 8)
    assert shape_logits(logits, SamplingParams(min_tokens=4), [1], [2], [3]) is logits
    with pytest.raises(ValueError, match="logit_bias"):
        shape_logits(logits, SamplingParams(logit_bias=((8, 1.0),)), [1], [], [3])


def test_a_batch_shapes_each_request_as_it_would_alone():
    """shape_batch over requests of every kind of shaping, one with nothing to shape among
    them, gives each request's rows shape_logits' own bits and leaves the others: a row of
    only -inf and an end keeps its end, a drafted id past the vocabulary is refused."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(11, 16, generator=generator) * 3
    logits[9] = float("-inf")
    logits[9, 2] = 0.5  # min_tokens yields to it
    requests = [  # (rows, params, prompt, output, drafted)
        (3, SamplingParams(presence_penalty=1.0, frequency_penalty=-0.4, repetition_penalty=1.3,
                           logit_bias=BIAS), [1, 2, 2], [2, 5, 5, 9], [5, 7]),
        (2, SamplingParams(repetition_penalty=0.7), [4], [4, 20], [3]),
        (1, SamplingParams(temperature=0), [1], [2], []),  # nothing to shape
        (3, SamplingParams(min_tokens=3, min_tokens_end_ids=(2, 5, 2), logit_bias=((2, 1.0),
                                                                                  (2, 3.0))),
         [1], [6], [2, 2]),
        (2, SamplingParams(min_tokens=2, min_tokens_end_ids=(2,), frequency_penalty=0.5),
         [3], [], [8]),
    ]
    shapings, start = [], 0
    for rows, params, prompt, output, drafted in requests:
        shapings.append(Shaping(start, rows, params, prompt, output, drafted))
        start += rows
    before = logits.clone()
    batch = shape_batch(logits, shapings)
    assert torch.equal(logits, before)  # the caller's logits untouched
    for shaping in shapings:
        rows = slice(shaping.start, shaping.start + shaping.rows)
        assert torch.equal(batch[rows], shape_logits(logits[rows], shaping.params,
                                                     shaping.prompt, shaping.output,
                                                     shaping.drafted))
    assert torch.equal(batch[5], logits[5])  # the request with nothing to shape
    assert batch[9, 2] == 0.5 and batch[7, 2] == batch[7, 5] == float("-inf")
    assert batch[8, 2] == logits[8, 2] + 3.0  # the last value given for an id
    assert shape_batch(logits, shapings[2:3]) is logits
    with pytest.raises(IndexError, match="past the vocabulary"):
        shape_batch(logits, [Shaping(0, 2, SamplingParams(presence_penalty=1.0), [1], [], [16])])


@pytest.mark.parametrize("group_bytes", [1, 8 << 20], ids=["a-group-a-call", "one-group"])
def test_the_verifier_shapes_its_calls_together_as_each_alone(monkeypatch, group_bytes):
    """ModelVerifier.shaped: each shaped call's rows as shape_logits gives them, whether the
    calls share one group of logits or each has its own; an unshaped call's rows untouched."""
    from types import SimpleNamespace

    from verifier import engine as verifier_engine

    monkeypatch.setattr(verifier_engine, "SHAPED_GROUP_BYTES", group_bytes)
    generator = torch.Generator().manual_seed(6)
    requests = [(SamplingParams(presence_penalty=1.0, logit_bias=BIAS), ([1, 2], [2, 9]), (4, 9)),
                (SamplingParams(temperature=0), None, (3,)),
                (SamplingParams(min_tokens=2, min_tokens_end_ids=(2,), repetition_penalty=1.2),
                 ([5], []), (2, 2, 6))]
    calls = [SimpleNamespace(sampling=params, draft_token_ids=drafted)
             for params, _, drafted in requests]
    logits = [torch.randn(len(drafted) + 1, 16, generator=generator)
              for _, _, drafted in requests]
    extras = [(None, history and dict(zip(("prompt", "output"), history)), None, None)
              for _, history, _ in requests]
    shaped = ModelVerifier.shaped(calls, logits, extras)
    for (params, history, drafted), rows, raw in zip(requests, shaped, logits):
        expected = raw if history is None else shape_logits(raw, params, *history, drafted)
        assert torch.equal(rows, expected)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The target alone, the whole sequence forwarded at every step, shaped by hand."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        for token, bias in params.logit_bias:
            logits[token] += bias
        if len(output) < params.min_tokens:
            logits[list(params.min_tokens_end_ids)] = float("-inf")
        output.append(int(logits.argmax()))
    return output


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@pytest.mark.parametrize("kind, k, pipelined", [("noisy", 3, False), ("noisy", "auto", True),
                                                ("ngram", 3, True)])
def test_shaped_greedy_equals_the_target_alone(target, kind, k, pipelined):
    """Each prompt's plain greedy output supplies the tokens to shape: its two most common
    tokens biased down and banned, its first token held back by min_tokens."""
    drafter = ModelDrafter(noisy_copy(target, 0.01, seed=1)) if kind == "noisy" \
        else NgramDrafter(64)
    verifier = ModelVerifier(target)
    accepted = drafted = 0
    for i, prompt in enumerate([[5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 3], [11]]):
        plain = reference_greedy(target, prompt, SamplingParams(temperature=0, max_tokens=16))
        common = sorted(set(plain), key=plain.count, reverse=True)
        params = SamplingParams(temperature=0, max_tokens=16, min_tokens=6,
                                min_tokens_end_ids=(plain[0],),
                                logit_bias=tuple(sorted({(common[0], -100.0),
                                                         (common[-1], -2.0)})))
        expected = reference_greedy(target, prompt, params)
        assert expected != plain and common[0] not in expected
        assert plain[0] not in expected[:6]
        alone, _ = run(drafter, verifier, prompt, params, 0, request_id=f"alone{i}")
        out, state = run(drafter, verifier, prompt, params, k, request_id=f"r{i}",
                         pipelined=pipelined)
        assert alone == out == expected, f"prompt {i}, K={k}, {kind} drafter"
        accepted += state.stats.num_accepted_tokens
        drafted += state.stats.num_draft_tokens
    assert drafted > 0 and (kind == "ngram" or 0 < accepted < drafted)


def test_the_request_fields_read_as_openais_and_vllms():
    body = CompletionRequest(prompt="x", logit_bias={"3": 4, " 7": -100}, min_tokens=2,
                             max_tokens=8, n=128)
    sampling = body.sampling(16)
    assert sampling.logit_bias == ((3, 4.0), (7, -100.0)) and sampling.min_tokens == 2
    for bad in ({"logit_bias": {"a": 1}}, {"logit_bias": {"3": 101}}, {"n": 129},
                {"min_tokens": -1}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **bad)
    assert CompletionRequest(prompt="x", min_tokens=9).max_tokens_or(16) == 16


def test_the_wire_carries_the_shaping():
    params = SamplingParams(temperature=0.5, logit_bias=BIAS, min_tokens=4,
                            min_tokens_end_ids=(0, 2))
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == \
        SamplingParams(temperature=0.5, logit_bias=BIAS, min_tokens=4,
                       min_tokens_end_ids=(0, 2), max_tokens=params.max_tokens)


def test_more_choices_than_the_router_runs_is_a_400_not_a_429():
    with pytest.raises(BadRequest) as refused:
        Admission(8).admit(9)
    assert refused.value.status == 400 and refused.value.param == "n"
    assert "9 choices (its prompts x n)" in str(refused.value)  # n = 3 for 3 prompts: 9


def test_a_bias_outside_the_vocabulary_is_refused_alone_before_the_forward():
    """At the pool boundary (a call straight from the wire): its batch-mate is answered."""
    from speculative.prefixes import prefix_hash
    from speculative.types import PrefixSync, ScoreCall
    verifier = ModelVerifier(tiny_llama(2))
    vocab = verifier.model.config.vocab_size
    bad = SamplingParams(temperature=0, logit_bias=((vocab, 1.0),))
    calls = [ScoreCall(name, PrefixSync(0, prefix_hash([]), (1, 2, 3)), (4,), sampling)
             for name, sampling in (("bad", bad), ("good", SamplingParams(temperature=0)))]
    refused, answered = verifier.score_batch(calls)
    assert isinstance(refused, ValueError) and "out of range" in str(refused)
    assert not isinstance(answered, Exception)


def test_the_metrics_tag_the_shaping_features():
    from deployments.metrics import features
    assert features(SamplingParams()) == []
    assert features(SamplingParams(logit_bias=BIAS, min_tokens=2, presence_penalty=1.0)) == [
        "penalties", "logit_bias", "min_tokens"]


def test_min_tokens_holds_the_end_tokens_under_ignore_eos_too(tiny_pair_dir):
    """As vLLM's min_tokens (its all_stop_token_ids): ignore_eos lets an end token be output
    without ending it, but not before min_tokens; the requested stop ids are held too."""
    import asyncio

    from deployments.prompts import PromptReader
    from deployments.router_args import RouterArgs
    from engine.checkpoint import Checkpoint
    from engine.models import load_tokenizer

    model = str(tiny_pair_dir / "target")
    reader = PromptReader(RouterArgs(model=model), load_tokenizer(model), Checkpoint.load(model))
    assert reader.end_ids
    for ignore_eos in (False, True):
        body = CompletionRequest(prompt="def ", max_tokens=8, min_tokens=4, stop_token_ids=[7],
                                 ignore_eos=ignore_eos)
        sampling = asyncio.run(reader.read(body, chat=False)).sampling
        assert set(sampling.min_tokens_end_ids) == {*reader.end_ids, 7}, ignore_eos


def test_the_bias_goes_in_before_the_penalties_as_vllms_sampler_orders_them():
    """vLLM's sampler applies logit_bias (a logits processor that is not argmax-invariant)
    before the penalties: a biased, seen token's logit is (logit + bias) / penalty when
    positive, (logit + bias) x penalty when negative (the bias added after the penalty passed
    every unit test)."""
    logits = torch.tensor([[1.0, 0.5, -3.0, 2.0]])
    params = SamplingParams(logit_bias=((0, 4.0), (2, 1.0)), repetition_penalty=2.0)
    rows = shape_logits(logits, params, [0], [2])
    torch.testing.assert_close(rows, torch.tensor([[2.5, 0.5, -4.0, 2.0]]))


def test_the_committed_tokens_split_at_the_prompts_length():
    """committed_history hands shaping the output's length as the committed tokens after
    the first prompt_len, a draft's tokens after them (a split one token late held the end
    ids one token longer and passed every unit test), and of its tokens only the last that
    bad_words read: no request without penalties has its whole output copied a row."""
    from types import SimpleNamespace

    from speculative.shaping import committed_history

    sequence = SimpleNamespace(committed=[1, 2, 3, 4, 5])
    params = SamplingParams(min_tokens=3, min_tokens_end_ids=(2,))
    history = committed_history(params, 3, sequence, [9])
    assert history == {"prompt": (), "output": [9], "skipped": 2}
    assert Shaping(0, 1, params, **history).output_len == 3
    words = SamplingParams(bad_words_ids=((4, 5, 6), (8,)))
    assert committed_history(words, 3, sequence, [9]) == \
        {"prompt": (), "output": [4, 5, 9], "skipped": 0}
    assert committed_history(words, 1, sequence) == {"prompt": (), "output": [4, 5],
                                                     "skipped": 2}
    logits = torch.zeros(2, 4)
    rows = shape_batch(logits, [Shaping(0, 2, params, drafted=[7], **history)])
    assert rows[:, 2].tolist() == [0.0, 0.0]  # 3 output tokens already: nothing held
    rows = shape_batch(logits, [Shaping(0, 2, params, drafted=[7],
                                        **committed_history(params, 4, sequence))])
    assert rows[:, 2].tolist() == [float("-inf"), float("-inf")]  # 1, then 2 tokens


def test_min_tokens_masks_no_entry_for_an_end_id_past_the_vocabulary():
    """An end id the logits' vocabulary does not hold (a smaller draft's) masks nothing:
    held as the flat index row x V + id, an id equal to V was the next row's first entry
    (and past the last row's), which passed every unit test."""
    logits = torch.zeros(2, 4)
    params = SamplingParams(min_tokens=5, min_tokens_end_ids=(4, 2))
    rows = shape_logits(logits, params, [1], [], [3])
    expected = torch.zeros(2, 4)
    expected[:, 2] = float("-inf")
    assert torch.equal(rows, expected)
