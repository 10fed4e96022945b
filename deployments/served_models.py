"""The names the router serves its model under, as vLLM's: its --served-model-name takes one
or several; /v1/models lists a card for each, a request may name any of them (or none), and
answers carry the first (vLLM's OpenAIServingModels: model_name() is base_model_paths[0]'s);
the tokenizer the router reads prompts with (served_tokenizer)."""

import time

from deployments.ingress import BadRequest, error_response
from engine.models import load_tokenizer

# a card's `created`: a Unix time, as vLLM's and OpenAI's are (0 read as 1970-01-01); the
# time this replica started, so that each answer gives the same card
STARTED = int(time.time())


def served_names(served_model_name: str | list[str]) -> tuple[str, ...]:
    """The router's served_model_name as its names, the answered one first."""
    if isinstance(served_model_name, str):
        return (served_model_name,)
    return tuple(served_model_name)


def model_card(name: str, model: str, context: int) -> dict:
    """The served model as vLLM's /v1/models lists it: `root` the checkpoint it serves
    (clients of vLLM load the tokenizer from `data[0].root`: without it, an AttributeError
    in OpenAI's client), `max_model_len` the context, and vLLM's one permission entry."""
    permission = {"id": "modelperm-specserve", "object": "model_permission",
                  "created": STARTED, "allow_create_engine": False, "allow_sampling": True,
                  "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None,
                  "is_blocking": False}
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "specserve",
            "root": model, "parent": None, "max_model_len": context,
            "permission": [permission]}


def card_named(name: str, names: tuple[str, ...], model: str, context: int):
    """/v1/models/{name}: the card of any served name (OpenAI's models.retrieve); another
    name (an empty one too: a card has a name) is not_served's 404, as a request naming it
    is."""
    if name not in names:
        return error_response(not_served(name, names))
    return model_card(name, model, context)


def model_list(names: tuple[str, ...], model: str, context: int) -> dict:
    """vLLM's /v1/models: a card for each name, in the order given."""
    return {"object": "list", "data": [model_card(name, model, context) for name in names]}


def check_model(asked: str | None, names: tuple[str, ...]) -> None:
    """not_served's BadRequest unless `asked` is one of the names; an empty name is the
    served model, as no name is (vLLM's: clients of servers that serve one model send "")."""
    if asked and asked not in names:
        raise not_served(asked, names)


def not_served(asked: str, names: tuple[str, ...]) -> BadRequest:
    """A 404 (model_not_found) for a name the router does not serve, naming those it does."""
    served = ", ".join(repr(name) for name in names)
    return BadRequest(f"model {asked!r} does not exist; this server serves {served}", 404,
                      "model")


def served_tokenizer(model: str, tokenizer: str | None):
    """The tokenizer the router reads prompts with: `tokenizer` when set, refused (naming it)
    where the target ships its own and the two map text to other ids: the pools see token
    ids only, so another vocabulary that fits the target's embedding rows served other
    tokens than the prompts' and decoded the output as other text, silently."""
    loaded = load_tokenizer(tokenizer or model)
    if tokenizer is None or tokenizer == model:
        return loaded
    try:
        own = load_tokenizer(model)
    except (OSError, ValueError):  # a target folder without a tokenizer: the arg's
        return loaded
    if own.get_vocab() != loaded.get_vocab():
        raise ValueError(f"tokenizer {tokenizer!r} maps text to other ids than the target "
                         f"{model!r}'s own tokenizer: leave tokenizer unset, or name one "
                         "of the same vocabulary")
    return loaded
