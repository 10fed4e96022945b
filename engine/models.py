"""Loading Hugging Face causal LMs, and where the offline demo pair lives.

torch and transformers are imported where a model is loaded, not here: the apps' args name
the demo pair, and a Serve app build imports only its args (deployments.apps)."""

import os
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"
DEMO_TARGET = str(DEMO_DIR / "target")
DEMO_DRAFT = str(DEMO_DIR / "draft")
DTYPES = ("float32", "bfloat16", "float16")  # torch's dtypes of those names


def expand_home(name_or_path: str) -> str:
    """A model written from the home folder ("~/..."), expanded: check_model_path reads it
    so, and transformers would otherwise take it for a malformed hub id."""
    return os.path.expanduser(name_or_path) if name_or_path.startswith("~") else name_or_path


MODEL_FILES = ("config.json",)
# what AutoTokenizer reads a folder's tokenizer by (a model's config names its class too)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def check_model_path(name_or_path: str, needs: tuple[str, ...] = MODEL_FILES) -> None:
    """ValueError naming it for a model that is written as a local path (absolute, or
    relative from "." or "..", or with more than one "/") and is not there: transformers
    would take it for a hub id and say the id is malformed; or for a local folder that
    holds none of the files `needs` names (transformers' error spoke of converting slow
    tokenizers)."""
    text = str(name_or_path)
    local = text.startswith(("/", "./", "../", "~")) or text.count("/") > 1
    path = Path(text).expanduser()
    if local and not path.exists():
        raise ValueError(f"no model at {text!r}: that folder does not exist")
    if path.is_dir() and not any((path / name).is_file() for name in needs):
        raise ValueError(f"no model at {text!r}: that folder holds no {' or '.join(needs)}")


def check_device(device: str) -> None:
    """ValueError naming it for a device this process cannot use, before any weights load:
    not a torch device, or a CUDA device where none is visible (a Serve replica whose
    ray_actor_options ask for no GPU sees none) or past the visible ones."""
    import torch

    try:
        where = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is no torch device (cpu, cuda or cuda:N)") \
            from None
    if where.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(f"device {device!r}: no CUDA device is visible here "
                         f"(CUDA_VISIBLE_DEVICES={visible!r}; a Serve replica needs num_gpus "
                         "in its ray_actor_options)")
    if where.index is not None and where.index >= count:
        raise ValueError(f"device {device!r}: only {count} CUDA device(s) visible here")


def load_causal_lm(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """Any causal LM `AutoModelForCausalLM` can load (a local folder or a hub id), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_device(device)
    check_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    check_model_path(name_or_path, TOKENIZER_FILES)
    return AutoTokenizer.from_pretrained(name_or_path)
