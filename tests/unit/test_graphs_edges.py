"""engine.graphs' and engine.runner's decisions a CPU can see, at their edges: the largest
bucket, a padded draft's ids past its embedding, a replay that fails after its capture
succeeded, the rotary embeddings never recorded, and an engine asked for by name."""

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import graphs
from engine import runner as engine_runner
from engine.batch import Segment
from engine.graphs import MAX_KEYS, GraphedForward, bucket_of, graphs_refused
from engine.kv import SessionStore
from engine.runner import serving_runner
from tests.tiny import tiny_llama
from tests.unit.test_checkpoints import longrope_config
from tests.unit.test_fallback_families import tiny_gemma2
from tests.unit.test_graphs import bucketed, verify_rounds


def test_a_batch_of_exactly_the_largest_keys_is_bucketed():
    assert bucket_of([Segment(None, [1], MAX_KEYS - 1, 1)], 16).keys == MAX_KEYS
    assert bucket_of([Segment(None, [1], MAX_KEYS, 1)], 16) is None


def test_a_padded_drafts_ids_past_its_embedding_replay_as_the_eager_forward_reads_them():
    """A draft with fewer embedding rows than the target's vocabulary is fed the target's
    ids: the bucketed forward clamps them as LeanForward does, and does not fail."""
    runner = bucketed("llama")
    top = runner.lean.embed.num_embeddings - 1
    fed = runner.forward([Segment(runner.new_cache(), [3, 1, 4, top + 5], 0, 4)])[0]
    assert runner.graphs.recorded  # it ran bucketed
    with torch.inference_mode():  # as ModelRunner.forward runs it
        eager = runner.lean([Segment(runner.new_cache(), [3, 1, 4, top], 0, 4)])[0]
    assert float((fed - eager).abs().max()) < 1e-5


def test_a_replay_that_fails_is_the_forwards_failure_and_keeps_its_graph(monkeypatch):
    """Only a capture's failure leaves the batch to the eager forward; a recorded graph whose
    replay fails raises to the caller, and its bucket stays recorded."""
    runner, replays = bucketed("llama"), []

    class Failing:
        def replay(self):
            replays.append(1)
            if len(replays) > 1:
                raise RuntimeError("replay failed")

    monkeypatch.setattr(graphs.Recorded, "record", lambda self, output: Failing())
    runner.graphs.capture = True
    store = SessionStore(4)
    with pytest.raises(RuntimeError, match="replay failed") as raised:
        verify_rounds(runner, store, [[3, 1, 4]], [[[1]], [[2]]])
    assert not isinstance(raised.value, graphs.GraphFailed)
    assert set(runner.graphs.recorded) == {(1, 3, 256), (1, 2, 256)} and not runner.graphs.eager


def test_longrope_rotary_embeddings_are_never_recorded():
    runner = serving_runner(LlamaForCausalLM(longrope_config(64, 1)).eval(), "paged", "paged",
                            kv_cache_tokens=4096)
    assert "longrope" in graphs_refused(runner.lean)
    assert isinstance(GraphedForward(runner.lean, capture=False), GraphedForward)


def test_the_paged_engine_asked_for_refuses_an_architecture_it_cannot_run():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="engine paged: "):
        serving_runner(tiny_gemma2(), "paged")
    assert serving_runner(tiny_gemma2()).lean is None  # auto: transformers' modeling


def test_auto_takes_regions_when_exactly_a_batch_of_them_fits_and_no_pool_size_is_set(
        monkeypatch):
    """`auto` on a CPU: regions when the budget holds MIN_REGIONS of them (a batch of 32 and
    one more), none fewer; a configured kv_cache_tokens sizes a paged pool."""
    monkeypatch.setattr(engine_runner, "region_count", lambda model, tokens, sequences: 33)
    assert engine_runner.regions_fit(tiny_llama(0), 64)
    monkeypatch.setattr(engine_runner, "region_count", lambda model, tokens, sequences: 32)
    assert not engine_runner.regions_fit(tiny_llama(0), 64)
    monkeypatch.setattr(engine_runner, "regions_fit", lambda model, sequences: True)
    assert serving_runner(tiny_llama(0), kv_cache_tokens=4096).attention == "paged"
