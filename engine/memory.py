"""How much memory a replica's KV pool may take, on any device.

A pool is sized once, at start-up, from what the device has left after the weights are
loaded: on a GPU its free memory less GPU_MEMORY_LEFT of the total (activations, the
attention plan's buffers and the CUDA graphs' live in that margin); on a CPU
CPU_MEMORY_FOR_KV of the memory available (Linux's MemAvailable, which already excludes the
loaded weights), less what one forward's activations and gather buffers take. A budget
that cannot hold one request at the model's context is a start-up error saying how much is
missing, never an allocator crash.
"""

import os

import torch

CPU_MEMORY_FOR_KV = 0.3  # of the memory available when a CPU pool is built, at most
GPU_MEMORY_LEFT = 0.1  # of the GPU's memory, left free for activations beside the pool
ACTIVATION_TOKENS = 4096  # tokens of one forward's activations counted against a CPU budget


class KVBudgetTooSmall(ValueError):
    """The memory left for a KV pool cannot hold one request at the model's context."""


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder's keys and values."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(model) -> int:
    layers, kv_heads, head_dim = kv_shape(model)
    return 2 * layers * kv_heads * head_dim * model.get_input_embeddings().weight.element_size()


def context_length(model) -> int:
    return getattr(model.config, "max_position_embeddings", None) or 2048


def available_memory_bytes() -> int:
    """The host memory a new allocation can take now: Linux's MemAvailable (free memory plus
    what the page cache can give back), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def activation_bytes(model) -> int:
    """One forward's working memory beside the pool: ACTIVATION_TOKENS tokens' hidden and
    MLP activations and logits, and their gathered keys and values."""
    config = model.config
    width = config.hidden_size * 4 + getattr(config, "intermediate_size", 0) * 2 + \
        config.vocab_size
    element = model.get_input_embeddings().weight.element_size()
    return ACTIVATION_TOKENS * (width * element + kv_bytes_per_token(model))


def kv_budget_bytes(model) -> int:
    """The bytes a new pool of this (loaded) model may take on its device."""
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - GPU_MEMORY_LEFT * total))
    return max(0, int(CPU_MEMORY_FOR_KV * available_memory_bytes()) - activation_bytes(model))


def too_small(model, needed_bytes: int, budget_bytes: int) -> KVBudgetTooSmall:
    device = model.get_input_embeddings().weight.device
    return KVBudgetTooSmall(
        f"the KV cache of one request at the model's {context_length(model)}-token context "
        f"takes {needed_bytes / 2**20:.0f} MiB, but only {budget_bytes / 2**20:.0f} MiB of "
        f"{device.type} memory is left for it: free memory, use a smaller dtype, or set "
        f"kv_cache_tokens")
