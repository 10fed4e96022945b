"""What a served pair must agree on, read from the checkpoints' configs at start-up.

Real checkpoints differ from the demo pair: instruct models end on several tokens
(`generation_config.json`), embedding matrices are padded beyond the tokenizer (and padded
differently across sizes of one family), context lengths differ, some attend through a
sliding window. Each check here fails at start-up with a message that names the setting, not
at the first round of the first request.
"""

from dataclasses import dataclass

from engine.models import check_model_path


@dataclass(frozen=True)
class Checkpoint:
    """The facts of one causal LM checkpoint the serving side needs (no weights loaded)."""

    path: str
    vocab_size: int  # rows of the output embedding: ids the model can score
    max_position_embeddings: int | None
    sliding_window: int | None  # None: every layer attends to the whole context
    # LongRoPE's original_max_position_embeddings: the context it serves exactly (long_rope)
    long_rope_from: int | None = None

    @classmethod
    def load(cls, path: str) -> "Checkpoint":
        from transformers import AutoConfig

        check_model_path(path)
        return cls.of(path, AutoConfig.from_pretrained(path))

    @classmethod
    def of(cls, path: str, config) -> "Checkpoint":
        config = getattr(config, "text_config", None) or config  # multimodal wrappers
        return cls(path, config.vocab_size, getattr(config, "max_position_embeddings", None),
                   sliding_window(config), long_rope(config))

    @property
    def served_positions(self) -> int | None:
        """The positions it is served exactly within: max_position_embeddings, or a
        LongRoPE model's original one (long_rope); None when it names neither."""
        bounds = [bound for bound in (self.max_position_embeddings, self.long_rope_from)
                  if bound]
        return min(bounds) if bounds else None


def long_rope(config) -> int | None:
    """A LongRoPE model's original_max_position_embeddings, else None. Past it the rotary
    takes its long factors for a whole forward (transformers' modeling and the lean forward
    alike choose them by the largest position of the call), so a request's logits would
    depend on its batch-mates', and the keys it cached below that position keep the short
    factors' rotation: served exactly only within it."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "longrope":
        return None
    return params.get("original_max_position_embeddings") or \
        getattr(config, "original_max_position_embeddings", None)


# architectures whose transformers modeling never reads the config's sliding_window
WINDOWLESS_MODEL_TYPES = {"llama"}


def sliding_window(config) -> int | None:
    """The attention window of a config whose layers (some or all) slide, else None."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) in WINDOWLESS_MODEL_TYPES:
        return None  # its modeling attends to the whole context whatever the config names
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def end_token_ids(path: str, tokenizer) -> tuple[int, ...]:
    """The ids that end a generation: generation_config's eos_token_id (an int or a list, as
    in Llama-3.1-Instruct's three) and the tokenizer's EOS, without duplicates."""
    generation = generation_config(path)
    if generation is not None:
        configured = generation.eos_token_id
    else:  # no generation_config.json: the model config's eos_token_id
        from transformers import AutoConfig

        configured = getattr(AutoConfig.from_pretrained(path), "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


# the sampling settings a checkpoint's generation_config.json may recommend, as vLLM reads
# them (its --generation-config auto); its max_new_tokens is left out: a request's length
# is the request's (or the router's default_max_tokens)
RECOMMENDED_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def recommended_sampling(path: str) -> dict:
    """The sampling settings the checkpoint's generation_config.json sets, {} without one
    (Llama-3.1-Instruct's: temperature 0.6, top_p 0.9)."""
    generation = generation_config(path)
    given = {} if generation is None else generation.to_diff_dict()
    return {name: given[name] for name in RECOMMENDED_SAMPLING if given.get(name) is not None}


def generation_config(path: str):
    """The checkpoint's transformers GenerationConfig, None without a generation_config.json."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def stop_token_ids(end_ids, requested=(), ignore_eos: bool = False) -> tuple[int, ...]:
    """A request's stop ids: the checkpoint's end tokens unless ignore_eos, plus its own."""
    return tuple(dict.fromkeys((() if ignore_eos else tuple(end_ids)) + tuple(requested)))


def reported_stop_ids(end_ids, requested=(), ignore_eos: bool = False) -> tuple[int, ...]:
    """The stop ids a stop_reason names: the request's own, less the checkpoint's end
    tokens unless ignore_eos (as vLLM, which checks the end token first and names none)."""
    return tuple(requested) if ignore_eos else tuple(t for t in requested if t not in end_ids)


def check_vocabularies(draft: Checkpoint, target: Checkpoint, num_tokens: int) -> None:
    """The draft can serve the target when both embeddings cover the tokenizer's tokens.

    Their sizes may differ by padding (Qwen2.5: 151665 tokens, 151936 or 152064 rows): the
    pools agree on the target's size; the drafter pads q with zeros or never draws beyond it.
    """
    for name, checkpoint in (("draft", draft), ("target", target)):
        if checkpoint.vocab_size < num_tokens:
            raise ValueError(
                f"the {name} {checkpoint.path!r} has {checkpoint.vocab_size} embedding rows but "
                f"the tokenizer of the target {target.path!r} has {num_tokens} tokens: draft and "
                "target must share the target's tokenizer")


def check_same_tokenizer(draft_tokenizer, target_tokenizer, draft_path: str,
                         target_path: str) -> None:
    """A draft that ships its own tokenizer must map text to the same ids as the target's.
    Both paths are named: a target left at its default (the demo's) is the usual cause."""
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"the draft {draft_path!r} has a different tokenizer from the target "
                         f"{target_path!r}: speculative decoding needs one vocabulary")


def served_positions(config) -> int | None:
    """A loaded model's config's Checkpoint.served_positions."""
    return Checkpoint.of("", config).served_positions


def context_limit(target: Checkpoint, max_context_tokens: int | None) -> int:
    """max_context_tokens, defaulting to the target's max_position_embeddings, never above it
    (nor above a LongRoPE target's original_max_position_embeddings: long_rope)."""
    limit = target.served_positions
    if max_context_tokens is None:
        if limit is None:
            raise ValueError(f"the target {target.path!r} names no max_position_embeddings: "
                             "set max_context_tokens")
        return limit
    if max_context_tokens < 2:
        raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
    if limit is not None and max_context_tokens > limit:
        if limit == target.long_rope_from:
            raise ValueError(
                f"max_context_tokens={max_context_tokens} exceeds the LongRoPE target's "
                f"original_max_position_embeddings={limit} ({target.path!r}): past it the "
                "rotary's long factors hold for a whole batch, so a request's tokens would "
                "depend on the requests beside it")
        raise ValueError(f"max_context_tokens={max_context_tokens} exceeds the target's "
                         f"max_position_embeddings={limit} ({target.path!r})")
    return max_context_tokens
