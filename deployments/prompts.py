"""A validated body read into what the request front end takes: the prompt's token ids
(tokenized off the event loop, within the context and the vocabulary), the sampling
parameters with max_tokens settled, the stop token ids."""

import asyncio
import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from deployments.bad_words import bad_words_ids
from deployments.chat_messages import (
    call_id_length,
    template_kwargs,
    template_variables,
    with_call_ids_cut,
)
from deployments.generation_defaults import recommended_defaults
from deployments.predictions import PredictionReader
from deployments.chat_templates import (UNTRUSTED, ChatTemplate, model_template, read_template,
                                        wants_system_first)
from deployments.ingress import BadRequest
from deployments.reasoning import (NO_REASONING_CONFIG, UNGATED, ThinkTokens, grammar_gate,
                                  thinking_budget)
from deployments.router_args import RouterArgs
from deployments.special_texts import check_special_texts, marked_contents, special_pattern
from deployments.tools import ToolError, check_forced, check_tools
from deployments.truncation import auto_truncated, fitted
from engine.checkpoint import (Checkpoint, context_limit, end_token_ids, reported_stop_ids,
                               stop_token_ids)
from speculative.grammar import GrammarError, compile_cached, grammar_tokenizer_or_none
from speculative.sampling import SamplingParams

# a text a piece of the prompt is tokenized after, then cut off (PromptReader.piece_ids)
ANCHOR = "\n"


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    sampling: SamplingParams  # the request's seed: the front end derives each choice's
    stop_token_ids: tuple[int, ...]
    text: str | None = None  # vLLM's return_prompt_text: the chat's rendered prompt
    # the end tokens under ignore_eos with a grammar after the reasoning: no stop inside it
    # (vLLM's engine samples and ignores them there), its grammar's stops after it
    free_in_reasoning: tuple[int, ...] = ()
    prediction_ids: tuple[int, ...] = ()  # a chat's predicted output (deployments.predictions)


class PromptReader:
    trusts_request_templates = False  # the router's trust_request_chat_template

    def __init__(self, args: RouterArgs, tokenizer, target: Checkpoint) -> None:
        self.tokenizer, self.vocab_size = tokenizer, target.vocab_size
        self.trusts_request_templates = args.trust_request_chat_template
        self.context_limit = context_limit(target, args.max_context_tokens)
        self.end_ids = end_token_ids(args.model, tokenizer)
        self.max_prompt_bytes = args.max_prompt_bytes
        self.default_max_tokens = args.default_max_tokens
        self.sampling_defaults = {} if args.generation_config == "vllm" else \
            recommended_defaults(args.model, target.vocab_size)
        # tokenizing is CPU work: off the event loop, one at a time (a fast tokenizer is not
        # safe to share between threads)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.grammar_tokenizer = grammar_tokenizer_or_none(tokenizer, target.vocab_size)
        self.predictions = PredictionReader(self.tokenizing, tokenizer, self.max_prompt_bytes,
                                            self.context_limit)
        self.reasoning_parser = args.reasoning_parser
        self.think_tokens = ThinkTokens.of(tokenizer, args.reasoning_parser) \
            if args.reasoning_parser else None
        self.grammar_in_reasoning = args.structured_outputs_enable_in_reasoning

    def within_context(self, body, sampling, prompt_tokens: int):
        """The sampling's max_tokens cut to the room the prompt leaves in the context (at
        least one token: token_ids), as vLLM 0.32 cuts it (its get_max_tokens); a 400 naming
        the field where it alone exceeds the context, or min_tokens the tokens left."""
        limit = self.context_limit
        # the field the client gave (OpenAI's newer one is read first)
        named = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if sampling.max_tokens > limit:
            raise BadRequest(f"{named} ({sampling.max_tokens}) exceeds the context limit of "
                             f"{limit}", param=named)
        room = limit - prompt_tokens
        cut = ", the room the prompt leaves" if sampling.max_tokens > room else ""
        sampling = replace(sampling, max_tokens=min(sampling.max_tokens, room))
        if body.min_tokens > sampling.max_tokens:
            raise BadRequest(f"min_tokens ({body.min_tokens}) must be at most {named} "
                             f"({sampling.max_tokens}{cut})", param="min_tokens")
        return sampling

    async def read(self, body, chat: bool) -> Prompt:
        self.check_sizes(body, chat)
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, self.token_ids, body, chat)
        # completions default to OpenAI's 16 tokens; chat may use the rest of the context
        # (either cut to the room the prompt leaves: within_context)
        limit = self.context_limit
        default = limit if chat else min(self.default_max_tokens, limit)
        sampling = self.within_context(body, body.sampling(default, self.sampling_defaults),
                                       len(prompt_ids))
        constraint = self.constraint(body)
        gated = False  # a grammar after the reasoning, as vLLM's front end reads it
        if constraint is not None:  # compiled off the event loop too
            field, kind, spec = constraint
            if self.grammar_tokenizer is None:
                raise BadRequest("structured outputs need a tokenizer llguidance can read "
                                 "(byte-level BPE or SentencePiece); this model's is not",
                                 param=field)
            try:
                grammar = await asyncio.get_running_loop().run_in_executor(
                    self.tokenizing, compile_cached, kind, spec, self.grammar_tokenizer)
            except GrammarError as error:
                raise BadRequest(f"{field} cannot compile: {error}", param=field) from None
            # under a reasoning parser, the grammar holds after the reasoning (vLLM 0.32's),
            # from the first token all the same under enable_in_reasoning (its engine's)
            after, at = grammar_gate(self.reasoning_parser, self.think_tokens, body, chat,
                                     prompt_ids)
            gated = bool(after)
            after, at = UNGATED if self.grammar_in_reasoning else (after, at)
            sampling = replace(sampling, grammar=grammar, grammar_after=after, grammar_at=at)
        if body.bad_words:  # tokenized off the event loop too
            words = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, bad_words_ids, self.tokenizer, body.bad_words,
                self.vocab_size)
            sampling = replace(sampling, bad_words_ids=words)
        if body.thinking_token_budget is not None:  # the parser's ids forced (vLLM's 400)
            if self.think_tokens is None:
                raise BadRequest(NO_REASONING_CONFIG, param="thinking_token_budget")
            sampling = replace(sampling, thinking_budget=thinking_budget(
                body.thinking_token_budget, self.think_tokens,
                constraint is not None and not gated))
        stop_ids = self.stop_ids(body, constraint is not None)
        if sampling.min_tokens:  # what min_tokens holds back: the end tokens and stop ids,
            # under ignore_eos too (vLLM's all_stop_token_ids: the end token is held until
            # min_tokens though it ends nothing)
            sampling = replace(sampling, min_tokens_end_ids=stop_token_ids(
                self.end_ids, stop_ids))
        text = None if not (chat and getattr(body, "return_prompt_text", False)) else \
            await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.rendered,
                                                             body)
        free = tuple(t for t in self.end_ids if t not in (body.stop_token_ids or ())) \
            if body.ignore_eos and sampling.grammar_after else ()
        prediction = getattr(body, "prediction", None)  # a chat's or a completion's
        predicted = () if prediction is None else await self.predictions.ids(prediction)
        return Prompt(prompt_ids, sampling, stop_ids, text, free, predicted)

    def rendered(self, body) -> str:
        """A chat's prompt as its template renders it, the messages' texts as written (vLLM's
        prompt_text; the ids read a special token's text in them as text: chat_ids)."""
        return self.chat_text(body, [m.for_template() for m in body.messages])

    def constraint(self, body):
        try:
            return body.constraint()
        except ValueError as error:  # a FieldError names its own field (any field's error)
            raise BadRequest(str(error), param=getattr(error, "param", "structured_outputs")
                             ) from None

    def check_sizes(self, body, chat: bool) -> None:
        """What must hold before tokenizing: the prompt's size in bytes, top_k, the ids of
        logit_bias, allowed_token_ids and logprob_token_ids, the top logprobs asked."""
        self.check_prompt_bytes(body, chat)
        if body.top_k > self.vocab_size:
            raise BadRequest(f"top_k must be at most the vocabulary size "
                             f"({self.vocab_size}); 0 disables it", param="top_k")
        if any(token >= self.vocab_size for token in body.logit_bias or {}):
            raise BadRequest(f"logit_bias token ids must be in [0, {self.vocab_size})",
                             param="logit_bias")
        for field in ("allowed_token_ids", "logprob_token_ids"):
            if any(token >= self.vocab_size for token in getattr(body, field) or ()):
                raise BadRequest(f"{field} must be in [0, {self.vocab_size})", param=field)
        if (body.top_logprobs_asked() or 0) > self.vocab_size:  # the pools' refusal: a 503
            field = "top_logprobs" if chat else "logprobs"
            raise BadRequest(f"{field} must be at most the vocabulary size "
                             f"({self.vocab_size})", param=field)

    def check_prompt_bytes(self, body, chat: bool) -> None:
        text = chat_texts(body) if chat else \
            [body.prompt] if isinstance(body.prompt, str) else []
        # (a lone surrogate, refused later naming its field, counts as the bytes it would be)
        size = sum(len(t.encode(errors="surrogatepass")) for t in text)
        if size > self.max_prompt_bytes:
            raise BadRequest(f"the prompt has {size} bytes; the limit is "
                             f"{self.max_prompt_bytes}", param="messages" if chat
                             else "prompt")

    def stop_ids(self, body, constrained: bool = False) -> tuple[int, ...]:
        """The end tokens (unless ignore_eos: a constrained output always ends at them, when
        its grammar is done) and the requested stop ids."""
        requested = tuple(body.stop_token_ids or ())
        if any(not 0 <= t < self.vocab_size for t in requested):
            raise BadRequest(f"stop_token_ids must be in [0, {self.vocab_size})",
                             param="stop_token_ids")
        return stop_token_ids(self.end_ids, requested, body.ignore_eos and not constrained)

    def reported_stop_ids(self, body) -> tuple[int, ...]:
        """The stop ids a stop_reason names (engine.checkpoint.reported_stop_ids)."""
        return reported_stop_ids(self.end_ids, body.stop_token_ids or (), body.ignore_eos)

    def token_ids(self, body, chat: bool) -> tuple[int, ...]:
        """The prompt's ids (a Responses' truncation auto: its oldest turns dropped to fit,
        deployments.truncation; truncate_prompt_tokens: its last ones, `truncated`), refused
        when empty or with no room left in the context."""
        ids = fitted(body, lambda kept: self.tokenized(kept, chat), self.context_limit) \
            if chat and auto_truncated(body) else self.tokenized(body, chat)
        if body.truncate_prompt_tokens is not None:
            ids = self.truncated(ids, body, chat)
        if not ids:
            raise BadRequest("the prompt is empty after tokenization", param="prompt")
        if len(ids) >= self.context_limit:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the limit is "
                             f"{self.context_limit - 1}", param="prompt")
        return ids

    def truncated(self, ids: tuple[int, ...], body, chat: bool) -> tuple[int, ...]:
        """The prompt's last truncate_prompt_tokens ids, as vLLM keeps them: -1 as many as
        leave room for the output's max tokens (a chat that names none: one), and a text's
        ids truncated inside what the tokenizer adds around them (a Llama checkpoint's BOS
        stays first, as transformers' truncation of vLLM's text prompts keeps it). A
        truncation_side given is vLLM's cut of the whole ids instead: "left" their last
        ones (a BOS then cut too), "right" their first ones."""
        keep = body.truncate_prompt_tokens
        if keep > self.context_limit:  # as vLLM's renderer, whatever the prompt's length
            raise BadRequest(f"truncate_prompt_tokens ({keep}) is greater than the context "
                             f"({self.context_limit})", param="truncate_prompt_tokens")
        if keep == -1:  # a length past the context is refused (within_context), one that
            # leaves no room cut; an echo's max_tokens 0 leaves room for one id (token_ids)
            keep = max(1, self.context_limit - max(1, body.max_tokens_or(
                1 if chat else self.default_max_tokens)))
        if len(ids) <= keep:
            return ids
        if body.truncation_side is not None:
            return ids[:keep] if body.truncation_side == "right" else ids[-keep:]
        text = chat or isinstance(body.prompt, str)
        head, tail = self.added_around if text and body.add_special_tokens else ([], [])
        room = keep - len(head) - len(tail)
        if room < 1 or list(ids[:len(head)]) != head or \
                list(ids[len(ids) - len(tail):]) != tail:
            return ids[-keep:]
        return (*head, *ids[len(head):len(ids) - len(tail)][-room:], *tail)

    def tokenized(self, body, chat: bool) -> tuple[int, ...]:
        """The prompt's ids as the model is fed them (/tokenize counts these)."""
        special = body.add_special_tokens  # vLLM's defaults: completions yes, chat no
        if chat:
            ids = self.chat_ids(body, special)
        elif isinstance(body.prompt, str):
            ids = self.tokenizer(body.prompt, add_special_tokens=special)["input_ids"]
        else:
            ids = body.prompt
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise BadRequest(f"prompt token ids must be in [0, {self.vocab_size})",
                                 param="prompt")
        return tuple(ids)

    def chat_ids(self, body, special: bool) -> list[int]:
        """The chat prompt's ids. A message whose content holds the text of one of the
        model's special tokens (a pasted document, a tool's result) has it read as text, as
        OpenAI reads it, not as the token (which would let that text end the turn and write
        another): its content goes through the template as a marker, and its ids, tokenized
        with the special tokens split, take the marker's place. The template's own special
        tokens stay tokens; other messages tokenize with the whole text, as vLLM's."""
        pattern = special_pattern(self.tokenizer)
        messages = [m.for_template() for m in body.messages]
        marked = marked_contents(messages, pattern)
        check_special_texts(body, pattern)
        text = self.chat_text(body, messages)
        if not marked:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]
        if any(text.count(marker) != 1 for marker in marked):
            raise BadRequest("a message holds the text of one of the model's special tokens, "
                             "which the chat template does not render as written",
                             param="messages")
        ids, spaces = [], ""  # a piece's trailing spaces go with the next: " hello" is a word
        for piece in re.split("(" + "|".join(marked) + ")", text):
            if piece in marked:
                ids += self.piece_ids(spaces + marked[piece], not ids, split=True)
                spaces = ""
            elif piece:
                kept = spaces + piece.rstrip(" ")
                spaces = piece[len(piece.rstrip(" ")):]
                ids += self.piece_ids(kept, not ids, split=False) if kept else []
        ids += self.piece_ids(spaces, not ids, split=False) if spaces else []
        return self.with_special_tokens(ids) if special else ids

    def piece_ids(self, piece: str, first: bool, split: bool) -> list[int]:
        """A piece of the prompt's text tokenized as it is inside the whole text. A tokenizer
        that marks where a text starts (SentencePiece's metaspace: "hello" is "_hello" there,
        not inside a text) would put a space at each piece's start: a later piece is
        tokenized after an anchor, whose ids are cut off (the piece alone where they differ:
        the anchor merged into it)."""
        def ids(text: str) -> list[int]:
            return self.tokenizer(text, add_special_tokens=False,
                                  split_special_tokens=split)["input_ids"]
        if first or not self.marks_start:
            return ids(piece)
        anchor, anchored = ids(ANCHOR), ids(ANCHOR + piece)
        return anchored[len(anchor):] if anchored[:len(anchor)] == anchor else ids(piece)

    def template_kwargs(self, body, template: ChatTemplate) -> dict:
        """The request's chat_template_kwargs the template reads (chat_messages'), with
        reasoning_effort's (ChatCompletionRequest.template_kwargs)."""
        given = body.template_kwargs()
        if not given:
            return {}
        return template_kwargs(given, template.variables,
                               set(getattr(self.tokenizer, "special_tokens_map", {})),
                               special_pattern(self.tokenizer))

    def chat_template(self, body) -> ChatTemplate:
        """The template a chat renders with: its own (chat_template) where the router trusts
        request templates (vLLM's 400 where it does not), else the model's."""
        given = getattr(body, "chat_template", None)  # (a completion has none)
        if given is None:
            return model_template(self.tokenizer, self.template_variables, self.call_id_length)
        if not self.trusts_request_templates:
            raise BadRequest(UNTRUSTED, param="chat_template")
        return read_template(self.tokenizer, given)

    @functools.cached_property
    def template_variables(self) -> frozenset[str] | None:
        """The variables the chat template reads (None where it cannot be parsed)."""
        return template_variables(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def call_id_length(self) -> int | None:
        """The length the chat template takes tool call ids of, where it takes no other
        (deployments.chat_messages.call_id_length: 9 for Mistral's); probed once."""
        return call_id_length(self.tokenizer)

    @functools.cached_property
    def system_first(self) -> bool:
        """Whether the model's template wants the system prompt first (probed once)."""
        return wants_system_first(self.tokenizer)

    @functools.cached_property
    def marks_start(self) -> bool:
        """Whether a text tokenizes otherwise at its start than after other text (probed)."""
        def ids(text: str) -> list[int]:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        anchor = ids(ANCHOR)
        return ids(ANCHOR + "x")[len(anchor):] != ids("x")

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """ids with what the tokenizer adds around a text (a BOS, say)."""
        head, tail = self.added_around
        return head + ids + tail

    @functools.cached_property
    def added_around(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds before and after a text's own; none when a text's own
        ids do not show among those it adds to (no tokenizer seen does that). The tokenizer's
        own: probed once (twice a request, before, on every marked chat and truncated text)."""
        bare = self.tokenizer("x", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("x", add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(full)) if full[i:i + len(bare)] == bare), None)
        return ([], []) if at is None else (full[:at], full[at + len(bare):])

    def chat_text(self, body, messages: list[dict]) -> str:
        """The messages (for_template's) through the chat template (the request's own where
        trusted: chat_template), up to the assistant's turn. A `developer` message (OpenAI's
        newer name for system) is a system message to a template that does not name the role
        (Qwen2.5's would drop it, Llama 3's write a header its model never saw), as vLLM and
        llama.cpp map it."""
        template = self.chat_template(body)
        if template.given is None and not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model has no chat template: use /v1/completions",
                             param="messages")
        try:  # the tools in effect are listed in the prompt (none for tool_choice "none")
            check_tools(body.tools)
            use = body.tool_use()
            if use is not None:
                check_forced(body.tools, use.forced)
        except ToolError as error:
            raise BadRequest(str(error), param=error.param) from None
        if template.call_id_length is not None:
            messages = with_call_ids_cut(messages, template.call_id_length)
        if not template.names_developer:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m
                        for m in messages]
        extra = self.template_kwargs(body, template)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=use.template_tools() if use else None,
                documents=body.documents or None, tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template=template.given, **extra)
        except Exception as error:  # a template may raise on roles or order it rejects
            raise template.rejected(error) from None
        # (the model's writes the request's texts, checked before; a request's, anything)
        return text if template.given is None else template.checked(text, self.max_prompt_bytes)


def chat_texts(body) -> list[str]:
    """The texts a chat request brings into its prompt: contents, calls' arguments, tools,
    the texts among chat_template_kwargs (a template may write them: Llama 3's date_string)."""
    texts = [(m.content or "") + (m.name or "") for m in body.messages]
    texts += [v for v in (body.chat_template_kwargs or {}).values() if isinstance(v, str)]
    texts += [key + text for document in body.documents or () for key, text in document.items()]
    texts += [call.function.arguments for m in body.messages for call in m.tool_calls or ()]
    if body.tools:
        try:
            texts.append(json.dumps([tool.model_dump() for tool in body.tools]))
        except RecursionError:  # a schema the body's parser read, a few frames shallower
            raise BadRequest("tools: a schema is nested too deeply", param="tools") from None
    return texts
