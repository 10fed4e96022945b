"""Loading Hugging Face causal LMs, and where the offline demo pair lives."""

from pathlib import Path

import torch

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"
DEMO_TARGET = str(DEMO_DIR / "target")
DEMO_DRAFT = str(DEMO_DIR / "draft")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """Any causal LM `AutoModelForCausalLM` can load (a local folder or a hub id), in eval mode."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype])
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)
