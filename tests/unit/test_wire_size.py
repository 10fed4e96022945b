"""Bytes on the wire per round, sampling mode, K = 5: small for any vocabulary size."""

import pytest

from deployments import wire
from drafter.model import ModelDrafter
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ProposeCall, ScoreCall
from tests.tiny import tiny_llama
from verifier.engine import ModelVerifier


@pytest.mark.parametrize("vocab_size", [4096, 128_000])
def test_a_sampled_round_is_at_most_8_kb_on_the_wire(vocab_size):
    target, draft = tiny_llama(1, vocab_size=vocab_size), tiny_llama(2, vocab_size=vocab_size)
    drafter = ModelDrafter(draft, draft_top_k=64)
    verifier = ModelVerifier(target)
    sampling = SamplingParams(temperature=1.0)
    prompt = tuple(range(1, 40))
    sync = PrefixSync(0, prefix_hash([]), prompt)
    propose = wire.propose_to_proto(ProposeCall("r", sync, 5, sampling, seed=1))
    block = drafter.propose_now(wire.propose_from_proto(propose))
    proposed = wire.block_to_proto(block)
    score = wire.score_to_proto(ScoreCall("r", sync, block.token_ids, sampling,
                                          wire.block_from_proto(proposed).draft_probs, seed=2))
    assert score.draft_probs.HasField("ids")  # q travels sparse
    scored = wire.scores_to_proto(verifier.score_now(wire.score_from_proto(score)))
    assert len(block.token_ids) == 5 and len(scored.sampled.recovered_token_ids) == 5
    # a round after the first carries only the tokens committed since (here 3), not the prompt
    later = PrefixSync(len(prompt), prefix_hash(prompt), (7, 8, 9))
    requests = [wire.propose_to_proto(ProposeCall("r", later, 5, sampling, seed=3)),
                wire.score_to_proto(ScoreCall("r", later, block.token_ids, sampling,
                                              block.draft_probs, seed=4))]
    total = sum(message.ByteSize() for message in [*requests, proposed, scored])
    assert total <= 8 * 1024, f"{total} bytes per round"
