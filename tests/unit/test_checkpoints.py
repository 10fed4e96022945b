"""Real checkpoints' properties on config-built look-alikes: several end tokens, padded
vocabularies that differ between draft and target, sliding-window attention; and the
start-up checks that refuse a pair that cannot work, naming the setting."""

import json
import re

import pytest

from specserve.cli import main
from engine.checkpoint import (
    Checkpoint,
    check_same_tokenizer,
    check_vocabularies,
    context_limit,
    end_token_ids,
    stop_token_ids,
)
from engine.models import load_tokenizer
from tests.conftest import QUIRKY_PROMPT


def cli(capsys, pair, *flags):
    code = main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "draft"),
                 "--json", "--prompt", QUIRKY_PROMPT, "--max-tokens", "40", *flags])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def report(pair) -> dict:
    return json.loads((pair / "report.json").read_text())


def test_the_look_alike_has_the_properties(quirky_pair_dir):
    target = Checkpoint.load(str(quirky_pair_dir / "target"))
    draft = Checkpoint.load(str(quirky_pair_dir / "draft"))
    tokenizer = load_tokenizer(str(quirky_pair_dir / "target"))
    assert len(tokenizer) < draft.vocab_size == 310 < target.vocab_size == 320
    assert target.sliding_window == draft.sliding_window == 16
    ends = end_token_ids(str(quirky_pair_dir / "target"), tokenizer)
    assert len(ends) == 4 and ends[-1] == tokenizer.eos_token_id  # three configured + EOS


@pytest.mark.parametrize("drafter, k", [("model", "0"), ("model", "3"), ("model", "6"),
                                        ("ngram", "4")])
def test_greedy_equals_the_target_alone_past_the_window_and_the_padding(capsys, quirky_pair_dir,
                                                                          drafter, k):
    result = cli(capsys, quirky_pair_dir, "--ignore-eos", "--drafter", drafter, "-k", k)
    choice = result["choices"][0]
    assert choice["token_ids"] == report(quirky_pair_dir)["greedy"]
    assert choice["finish_reason"] == "length"
    if drafter == "model" and k != "0":
        stats = result["stats"]
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rollbacks ran


def test_any_of_the_checkpoints_end_tokens_stops_the_request(capsys, quirky_pair_dir):
    expected = report(quirky_pair_dir)
    end_at = expected["end_at"]
    choice = cli(capsys, quirky_pair_dir, "-k", "4")["choices"][0]
    assert choice["token_ids"] == expected["greedy"][: end_at + 1]
    # as vLLM: an end token of the model's is no stop_reason, and no stop token's text is
    # part of the output's
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    tokenizer = load_tokenizer(str(quirky_pair_dir / "target"))
    assert choice["text"] == tokenizer.decode(choice["token_ids"][:-1], skip_special_tokens=True)


def test_an_end_token_requested_as_a_stop_token_id_is_no_stop_reason(capsys, quirky_pair_dir):
    """The CLI names the stop reason as the router does (PromptReader.reported_stop_ids): a
    checkpoint's own end token in --stop-token-id is none unless --ignore-eos (it named the
    id, where the router answers null for the same request)."""
    expected = report(quirky_pair_dir)
    end = expected["greedy"][expected["end_at"]]
    choice = cli(capsys, quirky_pair_dir, "-k", "4", "--stop-token-id", str(end))["choices"][0]
    assert choice["token_ids"] == expected["greedy"][: expected["end_at"] + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    named = cli(capsys, quirky_pair_dir, "-k", "4", "--stop-token-id", str(end),
                "--ignore-eos")["choices"][0]
    assert (named["finish_reason"], named["stop_reason"]) == ("stop", end)


def test_a_requested_stop_token_id_stops_too(capsys, quirky_pair_dir):
    greedy = report(quirky_pair_dir)["greedy"]
    choice = cli(capsys, quirky_pair_dir, "--ignore-eos", "--stop-token-id", str(greedy[2]),
                 "-k", "3")["choices"][0]
    end = greedy.index(greedy[2])
    assert choice["token_ids"] == greedy[: end + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", greedy[2])
    tokenizer = load_tokenizer(str(quirky_pair_dir / "target"))
    assert choice["text"] == tokenizer.decode(greedy[:end], skip_special_tokens=True)
    assert tokenizer.decode(greedy[end:end + 1], skip_special_tokens=True)  # text left out


def test_sampling_with_padded_vocabularies_runs_for_both_drafters(capsys, quirky_pair_dir):
    for drafter in ("model", "ngram"):
        result = cli(capsys, quirky_pair_dir, "--ignore-eos", "--drafter", drafter,
                     "--temperature", "1", "--seed", "3", "-k", "3", "--draft-top-k", "8")
        assert len(result["choices"][0]["token_ids"]) == 40


def test_a_refused_draft_names_the_target_it_was_checked_against(tiny_pair_dir):
    """A drafter given its `model` but whose `target` was left out (config.yaml's drafter names
    none) is checked against the demo target: the refusal names that target, so the user sees
    the setting to add, not only their draft (which matches their own target)."""
    from deployments.pool_args import DrafterArgs
    from drafter.registry import build_drafter
    from engine.models import DEMO_TARGET
    from specserve.demo import train_tokenizer

    args = DrafterArgs(model=str(tiny_pair_dir / "draft"))
    with pytest.raises(ValueError, match=re.escape(repr(DEMO_TARGET))):
        build_drafter(args.spec(), Checkpoint.load(args.target))
    other = load_tokenizer(str(tiny_pair_dir / "target"))
    with pytest.raises(ValueError, match="from the target 'my/target'"):
        check_same_tokenizer(train_tokenizer(["x = [1, 2]\n"] * 30, vocab_size=280), other, "d",
                             "my/target")


def test_start_up_refuses_pairs_that_cannot_work(quirky_pair_dir, tiny_pair_dir):
    target = Checkpoint.load(str(quirky_pair_dir / "target"))
    small = Checkpoint("small-draft", 200, 512, None)
    with pytest.raises(ValueError, match="200 embedding rows.*300 tokens"):
        check_vocabularies(small, target, 300)
    check_vocabularies(Checkpoint.load(str(quirky_pair_dir / "draft")), target, 300)
    other = load_tokenizer(str(tiny_pair_dir / "target"))
    from specserve.demo import train_tokenizer

    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(train_tokenizer(["x = [1, 2]\n"] * 30, vocab_size=280), other, "d",
                             "t")
    assert context_limit(target, None) == 512
    assert context_limit(target, 256) == 256
    with pytest.raises(ValueError, match="max_context_tokens=1024 exceeds the target's "
                                         "max_position_embeddings=512"):
        context_limit(target, 1024)


def test_a_routers_tokenizer_of_another_vocabulary_is_refused_at_start(tiny_pair_dir,
                                                                        tmp_path):
    """The router's `tokenizer` maps text to ids the pools take as the target's: one of fewer
    tokens than the target's rows passed the size check, and served other tokens than the
    prompts' (and decoded the output as other text) silently."""
    from deployments.served_models import served_tokenizer
    from specserve.demo import train_tokenizer

    target = str(tiny_pair_dir / "target")
    train_tokenizer(["x = [1, 2]\n"] * 30, vocab_size=280).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=f"tokenizer '{tmp_path / 'other'}' maps text"):
        served_tokenizer(target, str(tmp_path / "other"))
    load_tokenizer(target).save_pretrained(tmp_path / "same")
    assert served_tokenizer(target, str(tmp_path / "same")).get_vocab() == \
        load_tokenizer(target).get_vocab()


def longrope_config(vocab_size: int, layers: int):
    """A Phi-3-like Llama config: LongRoPE's long factors past 64 of its 256 positions."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "short_factor": [1.0] * 4, "long_factor": [8.0] * 4,
                                        "original_max_position_embeddings": 64})


def test_a_long_rope_target_serves_within_its_original_context():
    """Past original_max_position_embeddings LongRoPE's long factors hold for a whole forward
    (transformers' modeling and the lean forward alike): served beside a request past it, a
    short request's logits move. So its context defaults to that bound and no larger one is
    taken; within it a short request's logits are the same beside a long one."""
    import torch
    from transformers import LlamaForCausalLM

    from engine.batch import Segment
    from engine.runner import serving_runner
    from verifier.engine import ModelVerifier

    config = longrope_config(vocab_size=100, layers=2)
    target = Checkpoint.of("phi-like", config)
    assert target.long_rope_from == 64 and context_limit(target, None) == 64
    assert context_limit(target, 48) == 48
    with pytest.raises(ValueError, match="max_context_tokens=65 exceeds the LongRoPE target's "
                                         "original_max_position_embeddings=64"):
        context_limit(target, 65)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert ModelVerifier(model).max_positions == 64  # the CLI's bound, and the pool's check
    runner = serving_runner(model, "paged", kv_cache_tokens=4096)
    short = list(range(1, 11))
    alone = runner.forward([Segment(runner.new_cache(), short, 0, 10)])[0]

    def beside(length):
        other = [i % 100 for i in range(3, 3 + length)]
        return runner.forward([Segment(runner.new_cache(), short, 0, 10),
                               Segment(runner.new_cache(), other, 0, length)])[0]

    assert float((beside(64) - alone).abs().max()) < 1e-5  # within the served context
    assert float((beside(80) - alone).abs().max()) > 1e-4  # what the bound keeps out


def test_stop_token_ids_honour_ignore_eos():
    assert stop_token_ids((7, 8), (3,)) == (7, 8, 3)
    assert stop_token_ids((7, 8), (3,), ignore_eos=True) == (3,)
    assert stop_token_ids((7,), (7,)) == (7,)


def test_a_cuda_device_that_is_not_there_is_refused_before_the_weights_load(tmp_path):
    from engine.models import load_causal_lm

    with pytest.raises(ValueError, match="device 'cuda:99'"):
        load_causal_lm(str(tmp_path / "not-loaded"), "float32", "cuda:99")


def test_a_window_the_config_turns_off_is_no_window():
    """Qwen2 configs name a sliding_window with use_sliding_window false (Qwen2.5's), or
    layer_types without a sliding layer: their layers attend to the whole context."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from engine.checkpoint import sliding_window

    shape = dict(num_hidden_layers=2, sliding_window=4096)
    assert sliding_window(Qwen2Config(**shape, use_sliding_window=False)) is None
    # a config without layer_types (an older transformers', or another Qwen architecture's)
    assert sliding_window(SimpleNamespace(model_type="qwen2_moe", sliding_window=4096,
                                          use_sliding_window=False)) is None
    assert sliding_window(SimpleNamespace(model_type="mistral", sliding_window=4096)) == 4096
    assert sliding_window(Qwen2Config(**shape, use_sliding_window=True,
                                      layer_types=["full_attention"] * 2)) is None
    assert sliding_window(Qwen2Config(**shape, use_sliding_window=True,
                                      layer_types=["sliding_attention", "full_attention"])) == 4096
