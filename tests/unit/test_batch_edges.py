"""engine.batch's packed forward over transformers' modeling: an id past the model's
embedding (a draft whose vocabulary is padded differently from its target's) is fed as the
embedding's last row, not an index error that fails the whole batch."""

import torch

from engine.batch import Segment
from engine.runner import serving_runner
from tests.tiny import tiny_llama


def test_an_id_past_the_embedding_is_fed_as_its_last_row():
    runner = serving_runner(tiny_llama(0), "transformers")
    last = runner.model.get_input_embeddings().num_embeddings - 1
    past, clamped = runner.forward([Segment(runner.new_cache(), [5, last + 6, 7], 0, 2),
                                    Segment(runner.new_cache(), [5, last, 7], 0, 2)])
    torch.testing.assert_close(past, clamped)
