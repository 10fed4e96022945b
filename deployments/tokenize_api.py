"""vLLM's tokenizer endpoints: `POST /tokenize` gives a prompt's token ids exactly as a
completions or chat request with the same fields would feed them to the model (a chat's
through the template, its tools listed, a special token's text in a message read as text),
so a client can count a prompt against the context before it asks; `POST /detokenize` gives
the text of token ids."""

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from deployments.ingress import BadRequest
from deployments.openai_api import ChatCompletionRequest


class TokenizeCompletion(BaseModel):
    """A completion's prompt (vLLM's TokenizeCompletionRequest)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as a completions request's default
    return_token_strs: bool = False  # each id's token as the tokenizer writes it


class TokenizeChat(ChatCompletionRequest):
    """A chat's messages (and tools), rendered as /v1/chat/completions renders them (vLLM's
    TokenizeChatRequest); the sampling fields a chat request takes are read and unused."""

    return_token_strs: bool = False


class TokenizeRequest:
    """Either body, told apart as vLLM tells them: a chat's has messages."""

    @staticmethod
    def model_validate(data):
        chat = isinstance(data, dict) and "messages" in data
        return (TokenizeChat if chat else TokenizeCompletion).model_validate(data)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenized(prompts, body) -> dict:
    """vLLM's answer: the ids, their count and the context they must fit (prompt and output
    together); a prompt longer than the context is counted, not refused."""
    chat = isinstance(body, TokenizeChat)
    prompts.check_prompt_bytes(body, chat)
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(prompts.tokenizing, prompts.tokenized, body, chat)
    strs = None
    if body.return_token_strs:
        strs = prompts.tokenizer.convert_ids_to_tokens(list(ids))
    return {"count": len(ids), "max_model_len": prompts.context_limit, "tokens": list(ids),
            "token_strs": strs}


async def detokenized(prompts, body: DetokenizeRequest) -> dict:
    """The ids' text, special tokens written out (as vLLM's /detokenize)."""
    if any(not 0 <= token < prompts.vocab_size for token in body.tokens):
        raise BadRequest(f"tokens must be in [0, {prompts.vocab_size})", param="tokens")
    loop = asyncio.get_running_loop()
    text = await loop.run_in_executor(prompts.tokenizing, prompts.tokenizer.decode, body.tokens)
    return {"prompt": text}
