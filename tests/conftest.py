import pytest
import torch

from specserve.demo import train_tokenizer
from tests.tiny import noisy_copy, tiny_llama

# Tiny models gain nothing from threads, and two test workers must not fight over cores.
torch.set_num_threads(1)

TEXT = ["def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n"] * 20


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A tiny random target and draft with a real (tiny) tokenizer, saved like hub models."""
    root = tmp_path_factory.mktemp("tiny_pair")
    tokenizer = train_tokenizer(TEXT, vocab_size=300)
    target = tiny_llama(3, vocab_size=len(tokenizer))
    draft = noisy_copy(target, 0.05, seed=4)
    for name, model in (("target", target), ("draft", draft)):
        model.config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root
