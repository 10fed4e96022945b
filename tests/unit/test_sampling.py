import pytest
import torch
from transformers import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from speculative.draft_truncation import kept_entries
from speculative.sampling import (MAX_TEMPERATURE, SamplingParams, draft_law, inverted,
                                  logits_to_probs, sample, sample_each, sample_rows,
                                  seeded_generator)
from tests.stats.chisq import chi_square


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        # a law no float holds (q NaN, a draw past the vocabulary): the router serves these
        # greedy, a pool's call or the CLI is refused
        ({"temperature": 1e-30}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e39}, "temperature"),  # inf in float32: a masked logit NaN
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -3}, "seed"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": False}, "max_tokens"),
        ({"stop": "abc"}, "stop"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_params_raise_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_all_errors_are_reported_together():
    with pytest.raises(ValueError, match="temperature.*top_p"):
        SamplingParams(temperature=-1, top_p=2)


def hf_probs(logits, params):
    scores = logits.clone()[None]
    if params.temperature != 1:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.min_p:  # vLLM's place for it (transformers' own puts it after top-p)
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_logits_to_probs_matches_hugging_face_processors(temperature, top_k, top_p):
    """Target-only sampling in transformers uses these processors in this order: our one
    function must give the same distribution."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for _ in range(5):
        logits = torch.randn(50, generator=generator) * 3
        torch.testing.assert_close(logits_to_probs(logits, params), hf_probs(logits, params))


@pytest.mark.parametrize("temperature, min_p, top_k, top_p", [
    (1.0, 0.1, 0, 1.0), (0.5, 0.3, 0, 1.0), (1.7, 0.05, 5, 0.9), (1.0, 0.2, 0, 0.5),
    (1.0, 1.0, 0, 1.0)])
def test_min_p_drops_what_is_below_its_share_of_the_likeliest_before_top_k_and_top_p(
        temperature, min_p, top_k, top_p):
    """vLLM's min-p: after temperature, before top-k and top-p (a top-p after it sums the
    mass min-p left); min_p 1 keeps the likeliest alone."""
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for _ in range(5):
        logits = torch.randn(50, generator=generator) * 3
        probs = logits_to_probs(logits, params)
        torch.testing.assert_close(probs, hf_probs(logits, params))
        kept = (logits / temperature).softmax(-1)
        assert not probs[kept < min_p * kept.max()].any()
    if min_p == 1.0:
        assert probs.max() == 1.0


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.0, 4.9]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_top_k_keeps_the_largest_renormalised_and_no_zeros():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    values, ids = kept_entries(probs, 2, 1.0)
    assert ids.tolist() == [1, 3]
    torch.testing.assert_close(values, torch.tensor([4 / 7, 3 / 7]))
    values, ids = kept_entries(torch.tensor([0.0, 0.75, 0.25, 0.0]), 3, 1.0)
    assert ids.tolist() == [1, 2] and values.tolist() == [0.75, 0.25]


def test_mass_keeps_the_fewest_entries_holding_it_after_top_k():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.97, 0.01, 0.01, 0.01]])
    # row 0: 0.5 + 0.25 = 0.75 holds it; row 1: the top entry alone
    assert kept_entries(probs[0], 0, 0.75)[1].tolist() == [1, 3]
    assert kept_entries(probs[1], 0, 0.75)[1].tolist() == [0]
    # top 3 renormalised first: 0.5 / 0.9 < 0.75 <= (0.5 + 0.25) / 0.9
    values, ids = kept_entries(probs[0], 3, 0.75)
    assert ids.tolist() == [1, 3]
    torch.testing.assert_close(values, torch.tensor([0.5, 0.25]) / 0.9)


def test_draft_law_normalises_shipped_weights_and_refuses_impossible_ones():
    weights = torch.tensor([[1.0, 3.0], [0.0, 2.0]], dtype=torch.float16)
    torch.testing.assert_close(draft_law(weights), torch.tensor([[0.25, 0.75], [0.0, 1.0]]))
    for bad in ([[0.0, 0.0]], [[-0.5, 1.5]], [[float("nan"), 1.0]], [[float("inf"), 1.0]]):
        with pytest.raises(ValueError, match="draft_probs"):
            draft_law(torch.tensor(bad))


def test_a_seeded_draw_stays_in_step_when_a_truncated_q_keeps_one_entry_more():
    """Rounding at the mass boundary may keep one tiny entry more in a drafter's q; the same
    seed must then give the same draws (torch.multinomial took one exponential per entry, so
    every later draw of the request's generator moved: the replica-kill test's divergence)."""
    changed = 0
    for seed in range(200):
        drawn = torch.rand(50, generator=torch.Generator().manual_seed(seed))
        weights = drawn.sort(descending=True).values
        longer = torch.cat([weights, torch.tensor([1e-9])])
        generators = [seeded_generator(seed, "cpu") for _ in range(2)]
        draws = [[sample(w, g) for _ in range(4)] for w, g in zip((weights, longer), generators)]
        changed += draws[0] != draws[1]
    assert changed == 0


def test_sample_follows_unnormalised_weights_and_never_picks_a_zero():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0])
    generator = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([sample(weights, generator) for _ in range(20_000)]),
                            minlength=len(weights))
    statistic, threshold, _ = chi_square(counts.numpy(), (weights / weights.sum()).numpy(), 1e-7)
    assert statistic < threshold
    assert int(counts[weights == 0].sum()) == 0


def test_a_uniform_that_rounds_up_to_the_total_picks_the_last_positive_weight(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda *_, **kw: torch.tensor(1.0, dtype=kw["dtype"]))
    assert sample(torch.tensor([0.25, 0.75, 0.0]), torch.Generator()) == 1
    # rows whose last positive weight lies in different places, zeros between: each row's own
    weights = torch.tensor([[0.25, 0.75, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.5, 0.0],
                            [0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
    ones = torch.ones(4, 1, dtype=torch.float64)
    assert inverted(weights, ones).tolist() == [1, 3, 4, 1]
    assert inverted(weights, ones * 0.6).tolist() == [1, 3, 4, 1]
    assert inverted(weights, ones * 0.0).tolist() == [0, 0, 4, 1]


def test_the_largest_temperature_keeps_a_masked_logit_out_and_the_rest_uniform():
    logits = torch.tensor([[3.0, -2.0, float("-inf"), 0.5]])  # -inf: min_tokens' mask
    probs = logits_to_probs(logits, SamplingParams(temperature=MAX_TEMPERATURE))
    assert probs.tolist() == [[pytest.approx(1 / 3), pytest.approx(1 / 3), 0.0,
                               pytest.approx(1 / 3)]]


def test_a_row_holding_a_nan_draws_the_index_past_its_entries():
    """A model's NaN logits make a law of NaN: its draw is m, which the pools refuse
    (drafter.model.without_lawless, verifier.host.refusing_lawless), never a token."""
    weights = torch.tensor([[0.25, 0.75, 0.0], [float("nan")] * 3, [0.5, 0.5, 0.0]])
    for uniform in (0.0, 0.5, 1.0):
        drawn = inverted(weights, torch.full((3, 1), uniform, dtype=torch.float64))
        assert drawn[1] == 3 and drawn[0] < 2 and drawn[2] < 2


def test_sample_each_draws_each_row_as_its_generator_would_alone():
    """The drafter's batched draws: row r with generators[r], each generator's draw as it
    would be for its row alone (a seeded request drafts the same batched or not)."""
    weights = torch.rand(6, 10, generator=torch.Generator().manual_seed(3))
    weights[weights < 0.3] = 0.0
    skips = torch.randint(0, 9, (50, 6), generator=torch.Generator().manual_seed(4))
    for skip in skips.tolist():  # each call takes one uniform from each generator
        alone = [seeded_generator(seed, "cpu") for seed in range(6)]
        together = [seeded_generator(seed, "cpu") for seed in range(6)]
        for r in range(6):  # somewhere in their streams
            torch.rand(skip[r], generator=alone[r])
            torch.rand(skip[r], generator=together[r])
        expected = torch.cat([sample_rows(weights[r:r + 1], alone[r]) for r in range(6)])
        assert torch.equal(sample_each(weights, together), expected)
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(alone, together))


def test_sample_rows_draws_each_row_from_its_own_weights():
    """The verifier's residual and bonus draws: one row each, in one call."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0], [2.0, 0.0, 2.0, 4.0]])
    generator = torch.Generator().manual_seed(11)
    draws = torch.stack([sample_rows(weights, generator) for _ in range(20_000)])  # [n, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=4).numpy()
        statistic, threshold, _ = chi_square(counts, (weights[row] / weights[row].sum()).numpy(),
                                             5e-8)
        assert statistic < threshold


@pytest.mark.parametrize("asked, served", [(0, 0.0), (1e-6, 0.01), (5e-3, 0.01), (0.01, 0.01),
                                           (0.5, 0.5)])
def test_a_temperature_below_vllms_floor_samples_at_it(asked, served):
    """vLLM's SamplingParams raises a positive temperature below 1e-2 to 1e-2 and only 0 is
    greedy: the router and the CLI read one so, and the law is softmax(logits / 0.01)."""
    from deployments.openai_api import CompletionRequest
    from specserve.cli import build_parser
    from specserve.cli_args import sampling as cli_sampling

    params = CompletionRequest(prompt="x", temperature=asked).sampling(16)
    argv = ["generate", "--prompt", "x", "--temperature", str(asked)]
    assert params.temperature == cli_sampling(build_parser().parse_args(argv)).temperature \
        == served
    logits = torch.tensor([2.0, 1.99, 0.0, -1.0])
    expected = torch.nn.functional.one_hot(logits.argmax(), 4).float() if served == 0 else \
        (logits / served).softmax(-1)
    torch.testing.assert_close(logits_to_probs(logits, params), expected, atol=0, rtol=0)


def test_top_p_cuts_at_one_minus_top_p_in_float32_as_vllm():
    """vLLM holds top_p in float32: at 0.9 it drops a tail of mass up to 1 - float32(0.9) =
    0.100000024, where float32(1 - 0.9) = 0.1000000015 kept a tail of 0.10000001."""
    # a tail in that window after softmax, which rounds differently on different CPUs: the
    # first of the float32 values around it that lands there on this one
    tails = torch.tensor(0.10000001).repeat(17) + torch.arange(-8, 9) * 7.45e-9
    candidates = (torch.stack([tail, 1 - tail]).log() for tail in tails)
    logits = next(logits for logits in candidates
                  if 0.1000000015 < float(logits.softmax(-1)[0]) <= 0.100000024)
    probs = logits_to_probs(logits, SamplingParams(top_p=0.9))
    assert probs.tolist() == [0.0, 1.0]


def test_top_p_drops_a_tail_of_exactly_one_minus_top_p_and_never_the_top_token():
    """The cut is vLLM's and Hugging Face's: a sorted tail whose mass is <= 1 - top_p goes,
    equality included (four equal logits at top_p 0.75 keep three); and a top_p so small
    that 1 - top_p rounds to 1 in float32 still keeps the likeliest token, not an empty
    (NaN) law (a strict cut, or none kept, passed every unit test)."""
    probs = logits_to_probs(torch.zeros(4), SamplingParams(top_p=0.75))
    assert probs[0] == 0 and probs[1:].tolist() == pytest.approx([1 / 3] * 3)
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(top_p=1e-9))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not probs.isnan().any() and probs[1].tolist().count(1.0) == 1


def test_a_smaller_draft_vocabulary_is_padded_with_ids_it_never_draws():
    """fit_vocab pads a draft's logits to the target's vocabulary at -inf: the padded ids
    have q = 0, so the drafter never draws an id its own model cannot embed (padding with 0
    gave them a share of q and passed every unit test); a larger one is cut."""
    from speculative.sampling import fit_vocab

    logits = torch.tensor([[1.0, 2.0, 0.5]])
    padded = fit_vocab(logits, 5)
    probs = logits_to_probs(padded, SamplingParams())
    assert probs[0, 3:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(probs[0, :3], logits[0].softmax(-1))
    assert fit_vocab(logits, 2).tolist() == [[1.0, 2.0]]


def test_the_choices_of_a_seeded_request_get_distinct_seeds_that_repeat():
    """derive_seeds: n choices of one seeded request draw from n distinct seeds (one seed
    for all made the n samples one sample n times, which passed every unit test), the same
    ones for the same seed, each a non-negative int64; an unseeded request stays unseeded."""
    from speculative.sampling import derive_seeds

    seeds = derive_seeds(5, 4)
    assert len(set(seeds)) == 4 and seeds == derive_seeds(5, 4)
    assert all(0 <= seed < 2 ** 63 for seed in seeds) and seeds != derive_seeds(6, 4)
    assert derive_seeds(None, 3) == [None] * 3
