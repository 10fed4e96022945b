"""A request's prompt in its answer: vLLM's `prompt_logprobs` and the completions API's
`echo`.

- `prompt_logprobs: n` (vLLM's, both endpoints): beside each completion choice (a chat's: on
  the response), a list holding null for the prompt's first token, then for each later token
  {token id: {logprob, rank, decoded_token}} of the token and its position's top n (rank 1:
  the likeliest; decoded_token: the token decoded alone, special tokens kept).
- `echo` (completions): each choice's text is its prompt's text (as the client sent it;
  a prompt of token ids: their text) before its output's; with `logprobs: n`, the prompt's
  tokens come before the output's, the first with a null logprob and null top logprobs,
  and the text offsets run on from the prompt's tokens into the output's, as OpenAI and
  vLLM give them. Streamed, each choice's first chunk carries the prompt.

The logprobs are the target's raw ones (verifier.prompt_scores): one verifier call per
prompt (a completions batch's prompts, each once for its n choices), made as the request
starts, beside its decoding."""

import asyncio
from collections.abc import Sequence

from deployments.logprobs import TokenTexts, completion_logprobs, id_name, named_by_id, shown
from speculative.driver import Decode
from speculative.types import PromptLogprobs, TokenLogprob


class PromptAnswer:
    """What a request asked of its prompts: `prompt_logprobs` (None: not asked), echo's
    texts (None: no echo) and echo's logprobs (its `logprobs`, None: not asked)."""

    def __init__(self, verifier, request_id: str, prompts: Sequence[Sequence[int]],
                 top_n: int | None, echo: Sequence[str] | None, echo_top_n: int | None,
                 decode: Decode, special_decode: Decode, tokens_as_ids: bool = False) -> None:
        self.prompts, self.top_n = prompts, top_n
        self.tokens_as_ids = tokens_as_ids  # echo's tokens named by id, as the output's
        self.echo, self.echo_top_n = echo, echo_top_n
        self.decode, self.special_decode = decode, special_decode
        asked = max(top_n or 0, echo_top_n or 0)
        self.scores: list[asyncio.Future] = [] if top_n is None and echo_top_n is None else [
            asyncio.ensure_future(verifier.prompt_logprobs(f"{request_id}-prompt-{i}",
                                                           list(ids), asked))
            for i, ids in enumerate(prompts)]

    async def ready(self) -> list[PromptLogprobs]:
        """Each prompt's logprobs (none asked: [])."""
        return list(await asyncio.gather(*self.scores))

    def cancel(self) -> None:
        for future in self.scores:
            future.cancel()

    def completion_choice(self, body: dict, prompt: int, scores: list[PromptLogprobs]) -> dict:
        """A completions choice of prompt `prompt` with what was asked of it."""
        if self.echo is not None:
            body["text"] = self.echo[prompt] + (body["text"] or "")
            if body["logprobs"] is not None:
                body["logprobs"] = self.named(joined(self.echo_logprobs(prompt, scores),
                                                     body["logprobs"]), prompt, scores)
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

    def echo_logprobs(self, prompt: int, scores: list[PromptLogprobs]) -> dict | None:
        """The completions API's logprobs of the prompt's tokens (None: not asked)."""
        if self.echo_top_n is None:
            return None
        ids = self.prompts[prompt]
        texts = TokenTexts(self.decode)
        first = texts.detokenizer.add(ids[0])
        rest = completion_logprobs(self.echo_entries(prompt, scores), texts, len(first))
        return {"tokens": [first, *rest["tokens"]],
                "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": [0, *rest["text_offset"]]}

    def echo_entries(self, prompt: int, scores: list[PromptLogprobs]) -> list[TokenLogprob]:
        return [TokenLogprob(entry.token_id, entry.logprob, entry.top[:self.echo_top_n])
                for entry in scores[prompt].entries]

    def named(self, logprobs: dict | None, prompt: int, scores: list[PromptLogprobs]
              ) -> dict | None:
        """Logprobs that begin with the echo's with its tokens and their top ones named by id
        when the request asked (vLLM's return_tokens_as_token_ids, as the output's are:
        deployments.logprobs.named_by_id); the offsets still count the texts."""
        if logprobs is None or not self.tokens_as_ids:
            return logprobs
        ids = self.prompts[prompt]
        entries = self.echo_entries(prompt, scores)
        named = named_by_id({}, entries, chat=False)
        return {**logprobs, "tokens": [id_name(ids[0]), *named["tokens"],
                                       *logprobs["tokens"][len(ids):]],
                "top_logprobs": [None, *named["top_logprobs"],
                                 *logprobs["top_logprobs"][len(ids):]]}

    def echo_length(self, prompt: int, scores: list[PromptLogprobs]) -> int:
        """Where the output's text offsets start after an echo with logprobs: the length of
        the prompt's tokens' texts."""
        logprobs = self.echo_logprobs(prompt, scores)
        return 0 if logprobs is None else sum(len(token) for token in logprobs["tokens"])


def joined(prompt: dict | None, output: dict) -> dict:
    """The completions API's logprobs of the prompt's tokens then the output's, the output's
    text offsets moved past the prompt's tokens."""
    if prompt is None:
        return output
    shift = sum(len(token) for token in prompt["tokens"])
    return {"tokens": prompt["tokens"] + output["tokens"],
            "token_logprobs": prompt["token_logprobs"] + output["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + output["top_logprobs"],
            "text_offset": prompt["text_offset"] + [shift + o for o in output["text_offset"]]}
