"""A request's prompt in its answer: vLLM's `prompt_logprobs` and the completions API's
`echo`.

- `prompt_logprobs: n` (vLLM's, both endpoints): beside each completion choice (a chat's: on
  the response), a list holding null for the prompt's first token, then for each later token
  {token id: {logprob, rank, decoded_token}} of the token and its position's top n (rank 1:
  the likeliest; decoded_token: the token decoded alone, special tokens kept).
- `echo` (completions): each choice's text is its prompt's text (as the client sent it;
  a prompt of token ids: their text, special tokens skipped as skip_special_tokens says)
  before its output's; with `logprobs: n`, the prompt's tokens come before the output's,
  the first with a null logprob and null top logprobs, their texts joining into the echoed
  text (a special token's text in a text prompt, read as that token: its text; an id the
  tokenizer added around a text, a BOS: ""), and the text offsets run on from the
  prompt's tokens into the output's, as OpenAI and vLLM give them (the prompt's last token
  carries an incomplete character's U+FFFD, as its echoed text does: a prompt of token ids
  may end inside one); with return_tokens_as_token_ids, its tokens are named by id too (as
  vLLM). Streamed, each choice's first chunk carries the prompt.

The logprobs are the target's raw ones (verifier.prompt_scores): one verifier call per
prompt (a completions batch's prompts, each once for its n choices), made as the request's
answer starts (`start`: not before, so that a stream whose client left before its first
chunk, whose events never ran, leaves none running), beside its decoding."""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from deployments.logprobs import TokenTexts, completion_logprobs, id_name, named_by_id, shown
from speculative.driver import Decode
from speculative.types import PromptLogprobs, TokenLogprob


@dataclass(frozen=True)
class Echo:
    """A prompt as its echo shows it: its text, the decode its tokens' texts are read with,
    and how many of its ids the tokenizer added before and after a text's own (a BOS),
    which are not in the text: they read ""."""
    text: str
    decode: Decode
    added: tuple[int, int] = (0, 0)


def completion_echoes(sent: Sequence[str | Sequence[int]], prompts: Sequence[Sequence[int]],
                      added_around: tuple[list[int], list[int]], decode: Decode,
                      special_decode: Decode) -> list[Echo]:
    """The echo of each completions prompt as sent, beside its ids (`prompts`). A text is
    echoed as it is, so its tokens read with special tokens kept: a special token's text in
    it was tokenized to that token (vLLM's echo names it so too); the ids the tokenizer
    added around it (`added_around`, where they are there) read "". Token ids are echoed as
    the output is decoded (`decode`: as skip_special_tokens says), their tokens too."""
    head, tail = added_around

    def echo(prompt: str | Sequence[int], ids: Sequence[int]) -> Echo:
        if not isinstance(prompt, str):
            return Echo(decode(prompt), decode)
        around = list(ids[:len(head)]) == head and list(ids[len(ids) - len(tail):]) == tail
        return Echo(prompt, special_decode, (len(head), len(tail)) if around else (0, 0))

    return [echo(prompt, ids) for prompt, ids in zip(sent, prompts)]


class EchoTexts(TokenTexts):
    """TokenTexts of an echoed prompt's positions, read from its first: the ids added around
    a text's own read "" (their top tokens what they would have added there)."""

    def __init__(self, echo: Echo, length: int) -> None:
        super().__init__(echo.decode)
        self.own = range(echo.added[0], length - echo.added[1])
        self.at = 0  # the next position read

    def first(self, token_id: int) -> str:
        """The text of the prompt's first token (it has no logprob entry)."""
        self.at = 1
        return self.detokenizer.add(token_id) if 0 in self.own else ""

    def position(self, entry: TokenLogprob) -> dict[int, str]:
        self.at += 1
        if self.at - 1 in self.own:
            return super().position(entry)
        return {**{token_id: self.detokenizer.peek(token_id) for token_id, _ in entry.top},
                entry.token_id: ""}


class PromptAnswer:
    """What a request asked of its prompts: `prompt_logprobs` (None: not asked), echo's
    texts (None: no echo) and echo's logprobs (its `logprobs`, None: not asked)."""

    def __init__(self, verifier, request_id: str, prompts: Sequence[Sequence[int]],
                 top_n: int | None, echo: Sequence[Echo] | None, echo_top_n: int | None,
                 special_decode: Decode, tokens_as_ids: bool = False) -> None:
        self.verifier, self.request_id = verifier, request_id
        self.prompts, self.top_n = prompts, top_n
        self.echo, self.echo_top_n = echo, echo_top_n
        self.special_decode = special_decode
        self.tokens_as_ids = tokens_as_ids  # echo's tokens named by id (vLLM's option)
        self.scores: list[asyncio.Future] | None = None  # the calls, once started

    def start(self) -> None:
        """The verifier's calls, one per prompt, if not yet made (none asked: none)."""
        if self.scores is not None:
            return
        asked = max(self.top_n or 0, self.echo_top_n or 0)
        self.scores = [] if self.top_n is None and self.echo_top_n is None else [
            asyncio.ensure_future(self.verifier.prompt_logprobs(
                f"{self.request_id}-prompt-{i}", list(ids), asked))
            for i, ids in enumerate(self.prompts)]

    async def ready(self) -> list[PromptLogprobs]:
        """Each prompt's logprobs (none asked: [])."""
        self.start()
        return list(await asyncio.gather(*self.scores))

    def cancel(self) -> None:
        for future in self.scores or ():
            future.cancel()

    def completion_choice(self, body: dict, prompt: int, scores: list[PromptLogprobs]) -> dict:
        """A completions choice of prompt `prompt` with what was asked of it."""
        if self.echo is not None:
            body["text"] = self.echo[prompt].text + (body["text"] or "")
            if body["logprobs"] is not None:
                body["logprobs"] = joined(*self.echo_logprobs(prompt, scores),
                                          body["logprobs"])
        if self.top_n is not None:
            body["prompt_logprobs"] = self.listed(prompt, scores)
        return body

    def listed(self, prompt: int, scores: list[PromptLogprobs]) -> list[dict | None]:
        """vLLM's prompt_logprobs of prompt `prompt`."""
        rows: list[dict | None] = [None]
        for entry, rank in zip(scores[prompt].entries, scores[prompt].ranks):
            row = {str(token): self.item(token, logprob, i + 1)
                   for i, (token, logprob) in enumerate(entry.top[:self.top_n])}
            row.setdefault(str(entry.token_id), self.item(entry.token_id, entry.logprob, rank))
            rows.append(row)
        return rows

    def item(self, token: int, logprob: float, rank: int) -> dict:
        return {"logprob": shown(logprob), "rank": rank,
                "decoded_token": self.special_decode([token])}

    def echo_logprobs(self, prompt: int, scores: list[PromptLogprobs]
                      ) -> tuple[dict | None, int]:
        """The completions API's logprobs of the prompt's tokens (None: not asked) and the
        length of their texts, where the output's text offsets start. The last token's text
        takes what the detokenizer still holds (an incomplete character), as the prompt's
        echoed text does, so that the tokens join into it."""
        if self.echo_top_n is None:
            return None, 0
        ids = self.prompts[prompt]
        texts = EchoTexts(self.echo[prompt], len(ids))
        first = texts.first(ids[0])
        entries = [TokenLogprob(entry.token_id, entry.logprob, entry.top[:self.echo_top_n])
                   for entry in scores[prompt].entries]
        rest = completion_logprobs(entries, texts, len(first), end=True)
        if not entries:  # a prompt of one token
            first += texts.detokenizer.flush()
        length = len(first) + sum(len(token) for token in rest["tokens"])
        if self.tokens_as_ids:  # its texts' offsets and length counted before
            first, rest = id_name(ids[0]), named_by_id(rest, entries, chat=False)
        return {"tokens": [first, *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": [0, *rest["text_offset"]]}, length


def joined(prompt: dict | None, shift: int, output: dict) -> dict:
    """The completions API's logprobs of the prompt's tokens then the output's, the output's
    text offsets moved past the prompt's tokens' texts (`shift` characters)."""
    if prompt is None:
        return output
    return {"tokens": prompt["tokens"] + output["tokens"],
            "token_logprobs": prompt["token_logprobs"] + output["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + output["top_logprobs"],
            "text_offset": prompt["text_offset"] + [shift + o for o in output["text_offset"]]}
