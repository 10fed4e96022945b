"""The fan-out of one HTTP request: its n choices decoded concurrently over the pools,
answered as one completion body or as server-sent events."""

import asyncio
import json
import logging
import time
from concurrent.futures import Executor

from deployments.admission import Ticket
from deployments.held_text import StreamedText, StreamInterval
from deployments.ingress import pool_failure
from deployments.logprobs import ChoiceLogprobs, TokenBytes
from deployments.metrics import RouterMetrics
from deployments.predictions import prediction_usage
from deployments.prompt_logprobs import PromptAnswer
from deployments.reasoning import ReasoningSplit, ThinkTokens
from deployments.responses import (
    DeltaChunks,
    choice_body,
    chunk_body,
    completion_body,
    error_body,
    json_text,
)
from deployments.tools import ToolUse, call_deltas
from speculative.driver import Decode, Generation
from speculative.frontend import RequestPlan
from speculative.types import Drafter, PoolUnavailable, Verifier

log = logging.getLogger("ray.serve")


async def all_or_none(coroutines) -> list:
    """Run the coroutines concurrently; when one fails, cancel the others (no pool work goes
    on for a request that has already failed) and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Choices(ChoiceLogprobs):
    """An admitted request's choices: each its own speculative request, all succeeding or
    failing together; the admission ticket goes back once, however the request ends. Their
    logprobs are shaped as ChoiceLogprobs shapes them (deployments.logprobs)."""

    def __init__(self, plan: RequestPlan, pools: tuple[Drafter, Verifier], decode: Decode,
                 metrics: RouterMetrics, ticket: Ticket, *, model: str, chat: bool,
                 return_token_ids: bool, tokens_as_ids: bool = False,
                 tools: ToolUse | None = None,
                 include_usage: bool = False, continuous_usage: bool = False,
                 stop_token_ids: tuple[int, ...] = (),
                 token_bytes: TokenBytes | None = None,
                 render: Executor | None = None,
                 reasoning: ReasoningSplit | None = None,
                 think_tokens: ThinkTokens | None = None,
                 prompt: PromptAnswer | None = None, stream_interval: int = 1) -> None:
        self.plan, self.pools, self.decode = plan, pools, decode
        self.metrics, self.ticket = metrics, ticket
        self.model, self.chat, self.return_token_ids = model, chat, return_token_ids
        self.tools = tools  # the tools in effect: their calls are read out of each output
        # a chat's reasoning parser: each output split into reasoning and content (the
        # content alone read for calls)
        self.reasoning = reasoning
        # the router's reasoning parser's tags (None: no parser): usage counts the reasoning
        # tokens, 0 where this request's output is all content
        self.think_tokens = think_tokens
        # what the request asked of its prompts (prompt_logprobs, echo), or None
        self.prompt = prompt
        self.include_usage = include_usage  # streamed: a last chunk with the usage
        self.continuous_usage = continuous_usage  # and every chunk its choice's so far
        self.stream_interval = stream_interval  # the tokens a chunk waits for (StreamInterval)
        self.stop_token_ids = stop_token_ids  # the request's own (a stop_reason), not EOS
        self.token_bytes = token_bytes  # chat logprobs' bytes (deployments.logprobs)
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens by id (vLLM's option)
        # where a finished choice is read into its body (None: the loop's default executor)
        self.render = render
        # OpenAI's `created`: when the completion was created, on each chunk of its stream
        self.created = int(time.time())

    @property
    def request_id(self) -> str:
        """The answer's id: the client's request_id's where it gave one (RequestPlan)."""
        return self.plan.answer_id or self.plan.request_id

    async def run_choice(self, index: int, on_text) -> Generation:
        """Choice `index` decoded, on_text(generation, delta) awaited at each text delta."""
        choice = self.plan.choices[index]
        generation = Generation(choice.request, self.decode, self.stop_token_ids)
        started, first_text = time.monotonic(), None
        try:
            async for delta in generation.stream(*self.pools, choice.policy,
                                                 self.plan.pipelined):
                if first_text is None and delta:
                    first_text = time.monotonic() - started
                await on_text(generation, delta)
        finally:  # a failed or cancelled choice's rounds count too (retries, fallbacks)
            self.metrics.record_choice(generation.state, self.plan.prompt_tokens(index),
                                       first_text, time.monotonic() - started)
        return generation

    def all_choices(self, run):
        """run(index) for every choice, all or none (a coroutine)."""
        return all_or_none(run(index) for index in range(len(self.plan.choices)))

    async def complete(self) -> dict:
        return await self.off_loop(self.whole_body, *await self.finished())

    async def finished(self) -> tuple[list[Generation], list]:
        """(the choices' generations, the prompts' logprobs or []): whole_body's arguments
        (a batch of chats reads several: deployments.chat_batch)."""
        async def ignore(generation, delta):
            pass

        try:
            if self.prompt is not None:  # beside the decoding
                self.prompt.start()
            done = await self.all_choices(lambda index: self.run_choice(index, ignore))
            scores = await self.prompt.ready() if self.prompt is not None else []
        finally:
            if self.prompt is not None:
                self.prompt.cancel()
        return done, scores

    def off_loop(self, work, *args):
        """work(*args) on the render executor: reading a finished output's calls and its
        logprobs' texts is Python over every token (a chat's 2,048 with their top 20: 0.35 s
        that the event loop held every other stream for)."""
        return asyncio.get_running_loop().run_in_executor(self.render, work, *args)

    def whole_body(self, done: list[Generation], scores: list | None = None) -> dict:
        """The answer; scores: the prompts' logprobs, when the request asked for them."""
        choices = [self.whole_choice(i, g) for i, g in enumerate(done)]
        asked = self.prompt
        if asked is not None and not self.chat:
            choices = [asked.completion_choice(body, i // self.plan.n, scores)
                       for i, body in enumerate(choices)]
        body = completion_body(self.request_id, self.model, choices, self.usage(done),
                               self.plan.merged_stats(done), self.chat, self.created,
                               self.prompt_ids(0) if self.chat else None)
        if self.plan.prompt_text is not None:  # vLLM's return_prompt_text (a chat's)
            body["prompt_text"] = self.plan.prompt_text
        if asked is not None and self.chat:
            if asked.top_n is not None:
                body["prompt_logprobs"] = asked.listed(0, scores)
            for choice in choices if asked.echo is not None else ():
                message = choice["message"]
                message["content"] = asked.echo[0].text + (message["content"] or "")
        return body

    def usage(self, done: list[Generation]) -> dict:
        """OpenAI's usage; under a reasoning parser, with the reasoning's share of the
        completion tokens (`completion_tokens_details`, as vLLM sends it then): 0 where the
        output is not split, but deepseek_r1's (vLLM 0.32 counts its outputs' ids alone);
        with a prediction, its tokens the choices repeated and the rest (OpenAI's)."""
        usage = self.plan.usage(done)
        if self.think_tokens is not None:
            counted = self.reasoning is not None or self.think_tokens.nested
            reasoning = sum(self.think_tokens.count(g.token_ids) for g in done) if counted else 0
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        prediction = self.plan.choices[0].request.prediction_token_ids
        if prediction:
            usage.setdefault("completion_tokens_details", {}).update(
                prediction_usage(prediction, [g.token_ids for g in done]))
        return usage

    def prompt_ids(self, index: int) -> list[int] | None:
        """Choice `index`'s prompt ids when the request asked for token ids (vLLM's)."""
        if not self.return_token_ids:
            return None
        return list(self.plan.choices[index].request.prompt_token_ids)

    def whole_choice(self, index: int, generation: Generation) -> dict:
        """A finished choice's body; with a reasoning parser, its reasoning split off (vLLM's
        `reasoning`, "" when empty); with tools, its calls read out of its content."""
        reasoning, content, calls, finish_reason = self.read_output(generation)
        body = choice_body(index, content, finish_reason,
                           generation.stop_reason, self.chat,
                           generation.token_ids if self.return_token_ids else None,
                           self.logprobs(generation), calls, self.prompt_ids(index))
        if self.reasoning is not None:
            body["message"]["reasoning"] = reasoning if self.reasoning.shown else None
        return body

    def read_output(self, generation: Generation
                    ) -> tuple[str | None, str | None, list[dict], str | None]:
        """(reasoning, content, tool_calls, finish_reason) of a finished choice: its text
        split (deployments.reasoning), then its content read for calls (deployments.tools);
        no reasoning (None) and the whole text as content without a parser."""
        reasoning, content = self.reasoning.split(generation.text) \
            if self.reasoning is not None else (None, generation.text)
        if self.tools is None or content is None:
            return reasoning, content, [], generation.finish_reason
        return reasoning, *self.tools.read(content, generation.finish_reason)

    async def events(self):
        """Server-sent events: a first chunk per choice (chat: the role, as OpenAI sends it),
        one chunk per text delta, a final chunk per choice, the usage when asked
        (stream_options.include_usage, as OpenAI), [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()
        if self.prompt is not None:  # here, where the `finally` below will end them
            self.prompt.start()
        task = asyncio.ensure_future(
            self.all_choices(lambda index: self.stream_choice(index, queue)))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (chunk := await queue.get()) is not None:  # serialised JSON
                yield f"data: {chunk}\n\n"
            done = await task
            if self.include_usage:
                yield await self.off_loop(self.usage_event, done)
        except PoolUnavailable as error:  # the stream ends with an error event, then [DONE]
            failure = pool_failure(error, self.request_id)
            yield f"data: {json.dumps(error_body(str(failure), failure.status))}\n\n"
        except Exception:
            log.exception("unexpected error in the stream of %s", self.request_id)
            yield f"data: {json.dumps(error_body('internal error', 500))}\n\n"
        finally:  # the slots go back once the choices' task has ended, as a whole answer's
            # do (all_or_none): given back at the cancel, they admitted another request while
            # these still ran (a release that a repeated cancel cuts short goes on behind)
            task.cancel()
            if self.prompt is not None:
                self.prompt.cancel()
            try:
                await asyncio.gather(task, return_exceptions=True)
            finally:
                self.ticket.release()
        yield "data: [DONE]\n\n"

    def usage_event(self, done: list[Generation]) -> str:
        """The stream's last chunk: the usage and the choices' merged statistics. Off the
        event loop, as a whole answer's body: merging sorts every round's timings (128
        choices of 8,000 rounds: 0.4 s that every other stream waited for)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        stats = self.plan.merged_stats(done)
        final = {"id": self.request_id, "object": kind, "created": self.created,
                 "model": self.model, "choices": [], "usage": self.usage(done),
                 "speculative": stats.as_dict(), "metrics": stats.vllm_metrics()}
        return f"data: {json.dumps(final)}\n\n"

    async def stream_choice(self, index: int, queue: asyncio.Queue) -> Generation:
        """One choice's chunks into the queue: the role (chat: with its first text), its text
        deltas, each with the logprobs of its tokens committed since the last chunk when
        asked for (as OpenAI and vLLM), its end (with tools: what may be a call is held to the
        end, then sent as content or calls; with a reasoning parser, each delta's reasoning
        and content in their fields, as vLLM's)."""
        chunk = self.chunker(index)
        streamed = StreamedText(self.reasoning, self.tools)
        echo, echoed = (None, 0) if self.prompt is None or self.prompt.echo is None else \
            await self.echo(index)
        logged = self.streamed_logprobs(index, echoed)
        delta_text = self.delta_texts(index, chunk, logged)

        async def push(generation, delta):
            finished = generation.finish_reason is not None
            delta = interval.take(delta, generation.state.num_output_tokens, finished)
            if delta is not None:
                await send(generation, delta)

        async def send(generation, delta):
            if opening:  # with the usage so far: the prompt's tokens read from the cache
                await queue.put(opening.pop()(generation))
            if generation.finish_reason is not None and not streamed.parses:  # on the last
                return last.append(delta)  # chunk, as vLLM's (not an empty chunk after it)
            if (parts := streamed.feed(delta)) is None:
                return  # its tokens' logprobs go with the next chunk
            await queue.put(delta_text(generation, *parts))

        def ending(generation) -> list[str]:  # the last chunks, encoded a piece at a time
            _, content, calls, finish_reason = self.read_output(generation) if \
                streamed.parses else (None, None, [], generation.finish_reason)
            rest = streamed.rest(content)  # held back (content after all, or reasoning)
            chunks = [] if rest is None else [delta_text(generation, *rest, json_text)]
            if calls:
                chunks.append(chunk(None, generation=generation, encode=json_text,
                                    tool_calls=call_deltas(calls)))
            ids = generation.token_ids if self.return_token_ids else None
            chunks.append(chunk("".join(last) or None, finish_reason, generation, json_text,
                                token_ids=ids, stop_reason=generation.stop_reason,
                                logprobs=logged(generation, last=True) if logged else None,
                                prompt_token_ids=None if self.chat else prompt_ids))
            return chunks

        # the prompt's ids (return_token_ids): a chat's on its first chunk, as vLLM's; a
        # completion's beside its token_ids on its last (a first chunk is its first text)
        prompt_ids = self.prompt_ids(index)
        opening, last = self.opening(chunk, echo, streamed, prompt_ids), []
        if echo is not None:  # the prompt's text (and logprobs) first (as vLLM's)
            await queue.put(opening.pop()(None) if opening else
                            chunk(echo[0], logprobs=echo[1]))
        interval = StreamInterval(self.stream_interval)
        generation = await self.run_choice(index, push)
        if held := interval.rest():  # no delta came with the end
            await send(generation, held)
        # off the event loop: all from where a call may begin was held, its tokens' logprobs too
        opened = [first(generation) for first in opening]
        for text in [*opened, *await self.off_loop(ending, generation)]:
            await queue.put(text)
        return generation

    def delta_texts(self, index: int, chunk, logged):
        """delta_text(generation, reasoning, delta, encode=json.dumps): choice `index`'s
        chunk of a delta (its reasoning and content, as StreamedText.feed parts them), with
        its tokens' logprobs (`logged`) or its usage so far where asked for, else
        DeltaChunks' cheaper text."""
        texts = DeltaChunks(self.request_id, self.model, index, self.chat, self.created)
        thoughts = DeltaChunks(self.request_id, self.model, index, self.chat, self.created,
                               reasoning=True) if self.reasoning is not None else None

        def delta_text(generation, reasoning, delta, encode=json.dumps) -> str:
            if logged or self.continuous_usage or (reasoning and delta):
                return chunk(delta if delta or not reasoning else None, generation=generation,
                             encode=encode, logprobs=logged(generation) if logged else None,
                             reasoning=reasoning or None)
            return thoughts(reasoning) if reasoning else texts(delta)

        return delta_text

    def opening(self, chunk, echo, streamed: StreamedText, prompt_ids) -> list:
        """A chat's first chunk, its role (with tools, no content yet: a message of calls has
        none, null), sent with the first text: sent before the prefill, it was what clients
        time as the first token (vllm bench serve's TTFT: the first chunk with a choice);
        with an echo, at once with the last message's text (as vLLM's). As a function of the
        generation (None: not begun), whose usage so far it carries under continuous usage."""
        if not self.chat:
            return []
        head = echo[0] if echo is not None else "" if streamed.held is None else None
        return [lambda generation: chunk(head, prefilled=generation, role="assistant",
                                         prompt_token_ids=prompt_ids,
                                         prompt_text=self.plan.prompt_text)]

    def chunker(self, index: int):
        """chunk(text, finish_reason=None, generation=None, encode=json.dumps, prefilled=None,
        **fields): a chunk of choice `index`, with its usage so far under continuous usage (the
        prompt's tokens read from the cache once the generation, or `prefilled`, has them)."""
        prompt_tokens = len(self.plan.choices[index].request.prompt_token_ids)

        def chunk(text, finish_reason=None, generation=None, encode=json.dumps, prefilled=None,
                  **fields):
            body = chunk_body(self.request_id, self.model, index, text, finish_reason,
                              self.chat, created=self.created, **fields)
            if self.continuous_usage:  # the choice's tokens so far (vLLM's continuous usage),
                # counted without copying them (a copy a chunk: 4 s over 128k tokens)
                done = generation.state.num_output_tokens if generation is not None else 0
                body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                                 "total_tokens": prompt_tokens + done}
                read = prefilled if generation is None else generation  # its prompt read
                if read is not None:
                    body["usage"]["prompt_tokens_details"] = {
                        "cached_tokens": read.stats.cached_tokens}
            return encode(body)

        return chunk

    async def echo(self, index: int) -> tuple[tuple[str, dict | None], int]:
        """A streamed completion's echo: its first chunk's (text, logprobs), and where its
        output's text offsets start."""
        scores = await self.prompt.ready()
        prompt = index // self.plan.n
        logprobs, length = self.prompt.echo_logprobs(prompt, scores)
        return (self.prompt.echo[prompt].text, logprobs), length
