"""The drafter samples from exactly the q it ships, whatever the wire makes of q."""

import pytest
import torch

import drafter.model
from drafter.model import ModelDrafter
from speculative.sampling import SamplingParams, draft_law
from speculative.types import DraftDists, PrefixSync, ProposeCall, ScoreCall, prefix_hash
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

    def recording_sample_rows(weights, generator):  # the drafter draws one row at a time
        sampled.append((weights[0].clone(),
                        int(torch.multinomial(weights[0], 1, generator=generator))))
        return torch.tensor([sampled[-1][1]])

    monkeypatch.setattr(drafter.model, "sample_rows", recording_sample_rows)
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
