"""The drafter samples from exactly the q it ships, whatever the wire makes of q."""

import copy
from dataclasses import replace

import pytest
import torch

import drafter.model
from drafter.model import ModelDrafter
from speculative.accept import accept
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams, draft_law
from speculative.types import (
    LAWLESS,
    DraftBlock,
    DraftDists,
    PoolUnavailable,
    PrefixSync,
    ProposeCall,
    ScoreCall,
)
from tests.tiny import tiny_llama
from verifier.engine import ModelVerifier


def shipped_rows(q: DraftDists) -> list[dict[int, float]]:
    """Each position's {token id: weight > 0}, whichever form q travels in."""
    rows = []
    for i in range(len(q)):
        ids = range(q.vocab_size) if q.ids is None else q.ids[i].tolist()
        rows.append({t: w for t, w in zip(ids, q.weights[i].tolist()) if w > 0})
    return rows


@pytest.mark.parametrize("options", [
    {}, {"draft_top_k": 5}, {"draft_q_mass": 0.9}, {"draft_q_dtype": "float16"},
    {"draft_q_mass": 0.99, "draft_q_dtype": "float16"}, {"draft_q_mass": 0.5},
    {"draft_top_k": 8, "draft_q_mass": 0.9}])
def test_the_drafter_samples_from_the_q_it_ships(monkeypatch, options):
    sampled = []  # (the weights drawn from, the index drawn)

    def recording_sample_each(weights, generators):  # one row here: one request drafts
        (generator,) = generators
        sampled.append((weights[0].clone(),
                        int(torch.multinomial(weights[0], 1, generator=generator))))
        return torch.tensor([sampled[-1][1]])

    monkeypatch.setattr(drafter.model, "sample_each", recording_sample_each)
    engine = ModelDrafter(tiny_llama(2), **options)
    call = ProposeCall("r", PrefixSync(0, prefix_hash([]), (1, 2, 3)), 4,
                       SamplingParams(temperature=1.0), seed=5)
    block = engine.propose_now(call)
    assert len(sampled) == 4 == len(block.token_ids)
    q = block.draft_probs
    for shipped, (used, index), token in zip(shipped_rows(q), sampled, block.token_ids):
        assert sorted(shipped.values()) == sorted(used[used > 0].tolist())  # bit for bit
        assert shipped[token] == float(used[index])  # the drawn entry is the token's weight
    expected_dtype = torch.float16 if options.get("draft_q_dtype") == "float16" else torch.float32
    assert q.weights.dtype == expected_dtype
    truncated = "draft_top_k" in options or "draft_q_mass" in options
    assert (len(shipped_rows(q)[0]) < q.vocab_size) == truncated


def test_the_verifier_refuses_weights_no_drafter_could_have_sampled_from():
    verifier = ModelVerifier(tiny_llama(1))
    bad = torch.zeros(2, verifier.model.config.vocab_size)
    bad[0, 3], bad[1, 4] = 1.0, -1.0
    call = ScoreCall("r", PrefixSync(0, prefix_hash([]), (1, 2)), (3, 4),
                     SamplingParams(temperature=1.0), DraftDists.from_dense(bad), seed=1)
    with pytest.raises(ValueError, match="non-negative"):
        verifier.score_now(call)
    assert len(verifier.sessions) == 0  # refused before a cache was made


def test_draft_law_is_what_the_router_and_verifier_read():
    weights = torch.tensor([[2.0, 2.0, 0.0]], dtype=torch.float16)
    assert draft_law(weights).tolist() == [[0.5, 0.5, 0.0]]


@pytest.mark.parametrize("options", [{}, {"draft_top_k": 5}, {"draft_q_mass": 0.9},
                                     {"draft_top_k": 5, "draft_q_dtype": "float16"}])
@pytest.mark.parametrize("law", ["plain", "shaped", "narrow"])
def test_drafts_drawn_together_equal_each_drafted_alone(options, law):
    """Sampled drafts sharing their law draw in one batch of rows (each with its own
    generator); shaped ones (logit_bias here), even sharing one SamplingParams object, each
    alone, and so do rows that keep fewer entries than draft_top_k (top_k 3: "narrow").
    Every block, tokens and q, is the one its call drafts alone."""
    params = SamplingParams(temperature=0.9, top_k=3 if law == "narrow" else 0,
                            logit_bias=((7, 4.0), (9, -100.0)) if law == "shaped" else ())
    calls = [ProposeCall(f"r{i}", PrefixSync(0, prefix_hash([]), (1, 2 + i, 3)), 4, params,
                         seed=10 + i) for i in range(5)]
    together = ModelDrafter(tiny_llama(2), **options).propose_batch(calls)
    alone = [ModelDrafter(tiny_llama(2), **options).propose_now(call) for call in calls]
    for one, other in zip(together, alone):
        assert one.token_ids == other.token_ids
        assert one.draft_probs.weights.dtype == other.draft_probs.weights.dtype
        for row, other_row in zip(shipped_rows(one.draft_probs), shipped_rows(other.draft_probs)):
            assert row.keys() == other_row.keys()
            assert list(row.values()) == pytest.approx(list(other_row.values()), abs=1e-6)
    assert len({block.token_ids for block in together}) > 1  # each its own generator


def nan_logits(model, token: int):
    """`model` whose embedding of `token` is NaN: a sequence holding it gets NaN logits (as a
    model whose activations overflow does), one without it is untouched."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.embed_tokens.weight[token] = float("nan")
    return broken


@pytest.mark.parametrize("options", [{}, {"draft_top_k": 5}, {"draft_q_mass": 0.9},
                                     {"draft_q_dtype": "float16"},
                                     {"draft_top_k": 5, "draft_q_mass": 0.9}])
def test_a_draft_whose_logits_are_nan_ends_its_block_and_spares_its_batch(options):
    """A draft step whose law is NaN draws no token (it drew id V, past the vocabulary,
    which failed the verify; a truncated q failed the drafter's whole batch): the block
    ends before it, and the calls drafted beside it draft as they would alone."""
    model = nan_logits(tiny_llama(2), 7)
    params = SamplingParams(temperature=1.0)
    broken, sound = (ProposeCall(f"r{i}", PrefixSync(0, prefix_hash([]), prompt), 4, params,
                                 seed=3) for i, prompt in enumerate([(1, 7, 3), (1, 2, 3)]))
    blocks = ModelDrafter(model, **options).propose_batch([broken, sound])
    assert blocks[0].token_ids == () and blocks[0].draft_probs is None
    alone = ModelDrafter(model, **options).propose_now(sound)
    assert blocks[1].token_ids == alone.token_ids and len(alone.token_ids) == 4


def test_a_target_whose_logits_are_nan_fails_a_sampled_call_clearly():
    """A sampled position whose law is NaN has no token to draw: the call fails (a server
    fault), rather than answer id V, which the client would get as an output token."""
    verifier = ModelVerifier(nan_logits(tiny_llama(1), 7))
    call = ScoreCall("r", PrefixSync(0, prefix_hash([]), (1, 7, 3)), (), SamplingParams(),
                     seed=1)
    with pytest.raises(RuntimeError, match="not finite"):
        verifier.score_now(call)
    sound = ScoreCall("s", PrefixSync(0, prefix_hash([]), (1, 2, 3)), (), SamplingParams(),
                      seed=1)
    assert verifier.score_now(sound).bonus_token_id < verifier.vocab_size


def head_overflow(model, token: int):
    """`model` whose logits overflow to inf at the positions holding `token` alone (a head
    that overflows there, as a float16 head can), every hidden state, key and value finite:
    hidden dimension 0, which no layer reads or writes, holds 1 at `token`'s embedding only,
    and the head reads it x 1e38 into id 0's logit."""
    broken = copy.deepcopy(model)
    hidden = broken.config.hidden_size
    with torch.no_grad():
        for name, weight in broken.named_parameters():
            if weight.dim() == 2 and "embed" not in name and "lm_head" not in name:
                if weight.shape[1] == hidden:
                    weight[:, 0] = 0
                if weight.shape[0] == hidden:
                    weight[0, :] = 0
        broken.model.embed_tokens.weight[:, 0] = 0
        broken.model.embed_tokens.weight[token, 0] = 1.0
        broken.lm_head.weight[:, 0] = 0
        broken.lm_head.weight[0, 0] = 1e38
    return broken


def test_a_nan_law_past_the_rounds_end_fails_only_a_round_that_reaches_it():
    """Drafts 3, 7: the target's law after 7 (the bonus row) is NaN, the rows before it
    sound. A round whose coins reject 3 or 7 outputs a sound residual draw (a call failed
    for it: every such round failed, where the target alone fails only when it draws 7); a
    round that accepts both would output the bonus draw, and fails."""
    model = head_overflow(tiny_llama(1), 7)
    vocab = model.config.vocab_size
    q = torch.zeros(2, vocab)
    q[0, 3] = q[1, 7] = 1.0
    block = DraftBlock((3, 7), DraftDists.from_dense(q))
    for seed in range(20):
        call = ScoreCall("r", PrefixSync(0, prefix_hash([]), (1, 2, 3)), (3, 7),
                         SamplingParams(temperature=1.0), draft_probs=block.draft_probs,
                         seed=seed)
        scores = ModelVerifier(model).score_now(call)
        assert scores.bonus_token_id == LAWLESS and max(scores.recovered_token_ids) < vocab
        outcome, _ = accept(block, scores, False, torch.Generator().manual_seed(seed))
        assert outcome.num_accepted < 2 and 0 <= outcome.output_token_ids[-1] < vocab
    certain = replace(scores, draft_target_probs=(1.0, 1.0))  # coins that accept both
    with pytest.raises(PoolUnavailable, match="not finite"):
        accept(block, certain, False, torch.Generator().manual_seed(0))


def test_a_nan_law_beside_logprobs_fails_its_call_and_spares_its_batch():
    """A call asking for logprobs whose drawn row is NaN: its draw (id V) was read from the
    logprobs past the row's end, an IndexError that failed every call of the batch (on a
    GPU, a device-side assert)."""
    params = SamplingParams(temperature=1.0, logprobs=1)
    lawless, sound = (ScoreCall(name, PrefixSync(0, prefix_hash([]), prompt), (), params,
                                seed=1)
                      for name, prompt in (("lawless", (1, 2, 7)), ("sound", (1, 2, 3))))
    verifier = ModelVerifier(head_overflow(tiny_llama(1), 7))
    failed, scores = verifier.score_batch([lawless, sound])
    assert isinstance(failed, RuntimeError) and "not finite" in str(failed)
    assert scores.bonus_token_id < verifier.vocab_size and scores.logprobs is not None


@pytest.mark.parametrize("options", [{"draft_top_k": 5}, {"draft_q_mass": 0.9}, {}])
def test_reported_confidences_are_the_shipped_q_of_the_drawn_tokens(options):
    """A sparse q's drawn token is read by its id, not its place (the block's length and a
    tree's siblings follow these)."""
    engine = ModelDrafter(tiny_llama(2), **options)
    call = ProposeCall("r", PrefixSync(0, prefix_hash([]), (1, 2, 3)), 6,
                       SamplingParams(temperature=1.0), seed=11, draft_confidence=0.0)
    block = engine.propose_now(call)
    product, expected = 1.0, []
    for q_x in block.draft_probs.at(block.token_ids):
        product *= q_x
        expected.append(product)
    assert block.confidences == pytest.approx(expected, rel=1e-5)
