"""vLLM's tokenizer endpoints: `POST /tokenize` gives a prompt's token ids exactly as a
completions or chat request with the same fields would feed them to the model (a chat's
through the template, its tools listed, a special token's text in a message read as text),
so a client can count a prompt against the context before it asks; `POST /detokenize` gives
the text of token ids; `GET /tokenizer_info` (when the router enables it) the tokenizer's
config."""

import asyncio
import math

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.chat_messages import encodable
from deployments.ingress import BadRequest, error_response
from deployments.invocations import given
from deployments.openai_api import ChatCompletionRequest, SamplingFields


class TokenizeCompletion(SamplingFields):
    """A completion's prompt (vLLM's TokenizeCompletionRequest): the sampling fields a
    completions request takes are read and unused, as a chat's are (TokenizeChat), so that
    the body a client sends to /v1/completions is counted as it is (vLLM ignores them)."""

    prompt: str
    add_special_tokens: bool = True  # as a completions request's default
    # each id's token as the tokenizer writes it (null: vLLM's field is nullable, and a
    # chat's body takes a null as its default too)
    return_token_strs: bool | None = False

    @field_validator("prompt")
    @classmethod
    def valid_text(cls, value):  # as a completions prompt (a lone surrogate: no UTF-8)
        return encodable(value, "prompt")


class TokenizeChat(ChatCompletionRequest):
    """A chat's messages (and tools), rendered as /v1/chat/completions renders them (vLLM's
    TokenizeChatRequest); the sampling fields a chat request takes are read and unused."""

    return_token_strs: bool = False


class TokenizeRequest:
    """Either body, told apart as vLLM tells them: a chat's has messages (not null)."""

    @staticmethod
    def model_validate(data):
        chat = given(data, "messages")
        return (TokenizeChat if chat else TokenizeCompletion).model_validate(data)


class DetokenizeRequest(BaseModel):
    # fields it does not read are ignored, as vLLM's request bodies (and the chat's here) do
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenized(prompts, body) -> dict:
    """vLLM's answer: the ids, their count and the context they must fit (prompt and output
    together); a prompt longer than the context is counted, not refused."""
    chat = isinstance(body, TokenizeChat)
    prompts.check_prompt_bytes(body, chat)
    loop = asyncio.get_running_loop()
    ids, strs = await loop.run_in_executor(prompts.tokenizing, with_strings, prompts, body, chat)
    return {"count": len(ids), "max_model_len": prompts.context_limit, "tokens": ids,
            "token_strs": strs}


def with_strings(prompts, body, chat: bool) -> tuple[list[int], list[str] | None]:
    """On the tokenizing thread: the ids, and with return_token_strs each one's token (a
    prompt past the context may hold a million: a tenth of a second of the event loop's, and
    the tokenizer is used by one thread at a time)."""
    ids = list(prompts.tokenized(body, chat))
    return ids, prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None


async def detokenized(prompts, body: DetokenizeRequest) -> dict:
    """The ids' text, special tokens written out (as vLLM's /detokenize)."""
    loop = asyncio.get_running_loop()
    return {"prompt": await loop.run_in_executor(prompts.tokenizing, text_of, prompts,
                                                 body.tokens)}


def text_of(prompts, tokens: list[int]) -> str:
    """On the tokenizing thread: the ids' text, the ids checked first (a body of a million
    ids outside the vocabulary took 0.3-0.8 s of the event loop to name them, every stream
    of the router held meanwhile)."""
    check_in_vocabulary(tokens, prompts.vocab_size)
    return prompts.tokenizer.decode(tokens)


def check_in_vocabulary(tokens: list[int], vocab_size: int) -> None:
    """BadRequest naming the first few ids outside [0, vocab_size), and how many more."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size):
        return
    bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
    named = ", ".join(f"tokens[{i}] = {t}" for i, t in bad[:3])  # the first few
    raise BadRequest(f"tokens must be in [0, {vocab_size}): {named}"
                     + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""), param="tokens")


def tokenizer_info_answer(tokenizer, enabled: bool):
    """GET /tokenizer_info's answer: tokenizer_info, or a 404 unless the router enables it
    (its enable_tokenizer_info_endpoint), as vLLM's flag does."""
    if not enabled:
        return error_response(BadRequest("/tokenizer_info is off: the router's "
                                         "enable_tokenizer_info_endpoint enables it", 404,
                                         code=None))  # no model is missing
    return tokenizer_info(tokenizer)


def tokenizer_info(tokenizer) -> dict:
    """vLLM's /tokenizer_info answer: the tokenizer's config as it was loaded (its
    init_kwargs, tokenizer_config.json's fields), special tokens by their text, its class's
    name and the chat template chat requests are rendered with; without the paths of its
    files on this machine (vLLM drops vocab_file and merges_file; here every `*_file`)."""
    config = {key: plain(value) for key, value in (tokenizer.init_kwargs or {}).items()
              if not key.endswith("_file")}
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def plain(value):
    """A config value as JSON holds it: a special token (AddedToken) as its text, and what
    JSON has no type for as its str (an object, a NaN or an infinity: Python's json reads
    them from a tokenizer_config.json, and the answer that held one was a 500)."""
    if isinstance(getattr(value, "content", None), str):
        return value.content
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
