"""Edges of the demo pair's recipe (specserve.demo) without its training: the corpus and its
split, the encoding, the windows and the learning-rate schedule."""

import pytest
import torch

from specserve import demo
from specserve.demo import DemoRecipe


def test_the_learning_rate_warms_up_then_decays_to_a_tenth_of_its_peak():
    # 100 steps: 5 of linear warm-up to the peak, then a cosine down to 0.1 x the peak
    assert [demo.lr_at(step, 100, 1.0) for step in range(5)] == \
        pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert demo.lr_at(5, 100, 1.0) == pytest.approx(1.0)
    assert demo.lr_at(100, 100, 1.0) == pytest.approx(0.1)
    assert demo.lr_at(0, 1, 2e-3) == pytest.approx(2e-3)  # a one-step run: no warm-up to skip


def test_each_file_ends_with_the_end_token():
    tokenizer = demo.train_tokenizer(["def f(x):\n    return x\n"] * 4, vocab_size=300)
    ids = demo.encode(tokenizer, ["def f", "return x"]).tolist()
    eos = tokenizer.eos_token_id
    assert ids.count(eos) == 2 and ids[-1] == eos
    assert tokenizer.decode(ids[:ids.index(eos)]) == "def f"


def test_the_corpus_leaves_out_tests_and_holds_out_every_nth_file(monkeypatch, tmp_path):
    files = sorted(demo.stdlib_files())
    assert files and not any(demo.SKIPPED_DIRS & set(path.parts) for path in files)
    texts = []
    for i in range(5):
        (tmp_path / f"{i}.py").write_text(f"x = {i}\n")
        texts.append(f"x = {i}\n")
    monkeypatch.setattr(demo, "stdlib_files", lambda: sorted(tmp_path.glob("*.py")))
    train, val = demo.read_corpus(DemoRecipe(val_every=2))
    assert val == [texts[0], texts[2], texts[4]] and train == [texts[1], texts[3]]


def test_a_window_s_labels_are_its_inputs_one_token_on():
    recipe = DemoRecipe(seq_len=8, batch_size=3)
    data = torch.arange(100)
    inputs, labels = next(demo.batches(data, recipe, torch.Generator().manual_seed(0)))
    assert inputs.shape == labels.shape == (3, 8)
    assert torch.equal(labels, inputs + 1)
