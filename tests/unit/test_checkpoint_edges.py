"""engine.checkpoint's and engine.models' start-up checks at their edges, on configs built in
the test (no weights unless a dtype is the point): wrappers, older rope configs, bounds that
are exactly met, and the paths and devices refused before any weights load."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from engine.checkpoint import (
    Checkpoint,
    check_same_tokenizer,
    check_vocabularies,
    context_limit,
    end_token_ids,
    long_rope,
)
from engine.models import (TOKENIZER_FILES, check_device, check_model_path, load_causal_lm,
                           load_tokenizer)
from tests.tiny import tiny_llama


def text_config(**fields):
    shape = dict(vocab_size=320, max_position_embeddings=512, sliding_window=None)
    return SimpleNamespace(**{**shape, **fields})


def test_a_multimodal_wrappers_text_config_is_the_checkpoints():
    """Gemma-3 and Llama-4 wrap the language model's config in text_config; the wrapper
    itself names no vocab_size."""
    wrapper = SimpleNamespace(text_config=text_config(vocab_size=262_208))
    checkpoint = Checkpoint.of("gemma-3-like", wrapper)
    assert (checkpoint.vocab_size, checkpoint.served_positions) == (262_208, 512)


def test_longrope_named_in_an_older_rope_scaling_bounds_the_context():
    """Phi-3's config.json: rope_scaling says "type" (not "rope_type") and
    original_max_position_embeddings sits at the config's top level."""
    phi3 = text_config(max_position_embeddings=131_072, original_max_position_embeddings=4096,
                       rope_scaling={"type": "longrope", "short_factor": [1.0],
                                     "long_factor": [8.0]})
    assert long_rope(phi3) == 4096
    assert context_limit(Checkpoint.of("phi-3-like", phi3), None) == 4096
    inside = text_config(rope_scaling={"type": "longrope",
                                       "original_max_position_embeddings": 2048})
    assert long_rope(inside) == 2048
    assert long_rope(text_config(rope_scaling={"type": "linear", "factor": 2.0})) is None


def test_context_bounds_that_are_exactly_met_are_taken():
    target = Checkpoint("t", 320, 512, None)
    assert context_limit(target, 512) == 512 and context_limit(target, 2) == 2
    with pytest.raises(ValueError, match="max_context_tokens must be >= 2, got 1"):
        context_limit(target, 1)
    check_vocabularies(Checkpoint("d", 300, 512, None), target, 300)  # rows == tokens


def test_a_target_without_a_context_length_needs_one_configured():
    target = Checkpoint("no-length", 320, None, None)
    with pytest.raises(ValueError, match="'no-length' names no max_position_embeddings"):
        context_limit(target, None)
    assert context_limit(target, 100_000) == 100_000


def test_tokenizers_of_one_size_but_other_ids_are_refused():
    def tokenizer(vocab):
        return SimpleNamespace(get_vocab=lambda: vocab)

    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(tokenizer({"a": 0, "b": 1}), tokenizer({"a": 1, "b": 0}), "d", "t")
    check_same_tokenizer(tokenizer({"a": 0, "b": 1}), tokenizer({"b": 1, "a": 0}), "d", "t")


def test_without_a_generation_config_the_model_configs_end_tokens_stop(tmp_path):
    LlamaConfig(vocab_size=64, eos_token_id=[5, 6]).save_pretrained(tmp_path)
    assert not (tmp_path / "generation_config.json").exists()
    assert end_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=6)) == (5, 6)
    assert end_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=9)) == (5, 6, 9)


@pytest.mark.parametrize("path", ["./missing", "../missing", "a/b/missing", "/no/such/model",
                                  "~/no-such-model-here"])
def test_a_local_path_that_is_not_there_is_refused_by_name(path):
    with pytest.raises(ValueError, match="no model at"):
        check_model_path(path)


def test_a_folder_without_a_model_or_tokenizer_is_refused_by_name(tmp_path):
    """A folder that is there but holds no config.json (a model) or no tokenizer file (a
    tokenizer): transformers spoke of converting slow tokenizers instead."""
    with pytest.raises(ValueError, match="holds no config.json"):
        load_causal_lm(str(tmp_path))
    with pytest.raises(ValueError, match="holds no tokenizer.json or tokenizer_config.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    check_model_path(str(tmp_path), TOKENIZER_FILES)  # a tokenizer's folder, as a router's


def test_a_hub_id_is_left_to_transformers():
    check_model_path("meta-llama/Llama-3.2-1B-Instruct")
    check_model_path("gpt2")


def test_a_cuda_device_is_refused_where_none_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="no CUDA device is visible here"):
            check_device(device)
    check_device("cpu")
    with pytest.raises(ValueError, match="no torch device"):
        check_device("tpu:0")


def test_a_cuda_index_past_the_visible_ones_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1")
    check_device("cuda")
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        check_device("cuda:2")


def test_an_unknown_dtype_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_causal_lm(str(tmp_path / "not-loaded"), "int8")


def test_a_model_loads_in_the_dtype_asked_for(tmp_path):
    tiny_llama(0, layers=1).save_pretrained(tmp_path)
    for dtype in ("bfloat16", "float32"):
        model = load_causal_lm(str(tmp_path), dtype)
        assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
        assert not model.training
