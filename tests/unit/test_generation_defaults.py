"""The target's recommended sampling settings, as vLLM takes them (`--generation-config auto`,
its default): a request that leaves temperature, top_p, top_k, min_p or repetition_penalty
unset (or null) samples with the values the checkpoint's generation_config.json gives
(Llama-3.1-Instruct: temperature 0.6, top_p 0.9); one that sets them keeps its own; the
router's `generation_config: vllm` keeps OpenAI's defaults; settings no request could give
fail the router at start."""

import asyncio
import json
import shutil

import pytest

from deployments.openai_api import CompletionRequest
from deployments.prompts import PromptReader
from deployments.router_args import RouterArgs
from engine.checkpoint import Checkpoint, recommended_sampling
from engine.models import DEMO_TARGET, load_tokenizer

RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1, "max_new_tokens": 100}


def target_with(tmp_path, tiny_pair_dir, settings: dict | None):
    """The tiny pair's target in a directory of its own, with these generation settings."""
    path = tmp_path / "target"
    shutil.copytree(tiny_pair_dir / "target", path)
    config = path / "generation_config.json"
    given = json.loads(config.read_text()) if config.exists() else {}
    if settings is None:
        config.unlink(missing_ok=True)
    else:
        config.write_text(json.dumps({**given, **settings}))
    return str(path)


def reader(model: str, mode: str = "auto") -> PromptReader:
    return PromptReader(RouterArgs(model=model, generation_config=mode), load_tokenizer(model),
                        Checkpoint.load(model))


def sampled(reader: PromptReader, body):
    return asyncio.run(reader.read(body, chat=False)).sampling


def test_the_settings_read_are_the_sampling_ones(tmp_path, tiny_pair_dir):
    settings = recommended_sampling(target_with(tmp_path, tiny_pair_dir, RECOMMENDED))
    assert settings == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                        "repetition_penalty": 1.1}  # max_new_tokens and do_sample left out
    assert recommended_sampling(DEMO_TARGET) == {}  # the demo pair's: end tokens only


def test_unset_fields_take_the_targets_and_set_ones_their_own(tmp_path, tiny_pair_dir):
    recommended = reader(target_with(tmp_path, tiny_pair_dir, RECOMMENDED))
    unset = sampled(recommended, CompletionRequest(prompt="def ", max_tokens=4))
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p,
            unset.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    assert unset.max_tokens == 4
    null = sampled(recommended, CompletionRequest.model_validate(
        {"prompt": "def ", "temperature": None, "top_p": 0.5, "max_tokens": 4}))
    assert (null.temperature, null.top_p, null.top_k) == (0.6, 0.5, 20)
    greedy = sampled(recommended, CompletionRequest(prompt="def ", temperature=0, top_k=0,
                                                    max_tokens=4))
    assert greedy.greedy and greedy.top_k == 0 and greedy.repetition_penalty == 1.1
    neutral = sampled(reader(target_with(tmp_path / "v", tiny_pair_dir, RECOMMENDED), "vllm"),
                      CompletionRequest(prompt="def ", max_tokens=4))
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p,
            neutral.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def test_without_settings_the_defaults_are_openais(tmp_path, tiny_pair_dir):
    for settings in (None, {"eos_token_id": 2}):
        plain = sampled(reader(target_with(tmp_path / str(settings is None), tiny_pair_dir,
                                           settings)),
                        CompletionRequest(prompt="def ", max_tokens=4))
        assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


@pytest.mark.parametrize("settings, named", [({"temperature": 5.0}, "temperature"),
                                             ({"top_k": 100_000}, "top_k")])
def test_settings_no_request_could_give_fail_the_router_at_start(tmp_path, tiny_pair_dir,
                                                                  settings, named):
    model = target_with(tmp_path, tiny_pair_dir, settings)
    with pytest.raises(ValueError, match=f"generation_config.json .*{named}.*\"vllm\""):
        reader(model)
    assert reader(model, "vllm").sampling_defaults == {}
