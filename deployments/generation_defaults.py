"""The target's recommended sampling settings (its generation_config.json), as vLLM's
defaults for a request that leaves them unset."""

import logging

from pydantic import ValidationError

from deployments.openai_api import SamplingFields
from engine.checkpoint import recommended_sampling

log = logging.getLogger("ray.serve")


def recommended_defaults(model: str, vocab_size: int) -> dict:
    """The target's generation_config.json's sampling settings (vLLM's defaults for a
    request that leaves them unset), checked as a request's fields are: a checkpoint whose
    settings no request could give fails at start, naming them."""
    defaults = recommended_sampling(model)
    try:
        SamplingFields.model_validate(defaults)
        problems = [] if defaults.get("top_k", 0) <= vocab_size else \
            [f"top_k: above the vocabulary size ({vocab_size})"]
    except ValidationError as error:
        problems = [f"{e['loc'][0]}: {e['msg']}" for e in error.errors()]
    if problems:
        raise ValueError(f"{model}'s generation_config.json recommends sampling settings a "
                         f"request could not give ({'; '.join(problems)}); set the router's "
                         "generation_config to \"vllm\" to leave them unused")
    if defaults:
        log.warning("requests that leave them unset sample with the target's "
                    "generation_config.json's %s (generation_config: vllm for OpenAI's "
                    "defaults)", defaults)
    return defaults
