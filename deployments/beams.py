"""vLLM's `use_beam_search` on the OpenAI endpoints: what it combines with, and its answer
rendered as any request's choices (deployments.choices), the search itself the target's
alone (speculative.beams).

As vLLM's: `n` is the beam width and the answer's n choices are the n best beams; the
request's length_penalty, ignore_eos, include_stop_str_in_output and max_tokens steer it; an
output ends at the tokenizer's EOS alone (finish_reason "stop", stop_reason the EOS id) or at
max_tokens ("length"); a chat streams its answer whole once searched (a role chunk, then one
chunk a choice), a completion does not stream (a 400, as vLLM's). What vLLM's search would
ignore while the request asks for it (sampling filters, penalties, stop strings, a
constraint, tools) is refused, naming the field."""

import time

from deployments.choices import Choices, all_or_none
from deployments.tools import FieldError
from speculative.beams import MAX_BEAM_WIDTH, Beam, BeamParams, BeamSearch
from speculative.driver import Generation
from speculative.state import Request

# the fields beam search does not read, at the values that ask for nothing (vLLM's search
# reads neither: given, they would be silently unanswered)
IGNORED = {"top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
           "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0,),
           "stop": (None, []), "stop_token_ids": (None, []), "logit_bias": (None, {}),
           "allowed_token_ids": (None,), "bad_words": (None, []),
           "logprob_token_ids": (None,), "repetition_detection": (None,),
           "thinking_token_budget": (None,)}


def refuse_unsearched(body, chat: bool) -> None:
    """FieldError for what a beam search request asks that the search cannot answer."""
    if not body.use_beam_search:
        return
    if body.stream and not chat:
        raise FieldError("stream", "streaming is not supported with beam search (as vLLM's)")
    if body.n > MAX_BEAM_WIDTH:
        raise FieldError("n", f"the beam width (n) is at most {MAX_BEAM_WIDTH} with beam "
                              f"search, got {body.n}")
    if body.max_tokens_or(1) == 0:
        raise FieldError("max_tokens", "must be at least 1 with beam search")
    for name, served in IGNORED.items():
        if getattr(body, name) not in served:
            raise FieldError(name, "not applied by beam search: leave it unset")
    if found := body.constraint():  # a forced tool call's is the tool_choice's
        raise FieldError(found[0], "a constraint is not applied by beam search")
    if chat and body.tools:
        raise FieldError("tools", "tools are not served with beam search")


def choices_kind(body, prompts):
    """The class that answers the request's choices: Choices, or BeamChoices for a beam
    search (a factory taking Choices' arguments), whose end token is the EOS of the
    tokenizer prompts are read with (vLLM's: not the generation config's end tokens)."""
    if not body.use_beam_search:
        return Choices
    return lambda *args, **kwargs: BeamChoices(
        *args, eos_token_id=prompts.tokenizer.eos_token_id, ignore_eos=body.ignore_eos,
        length_penalty=body.length_penalty, **kwargs)


class BeamChoices(Choices):
    """Choices whose outputs are each prompt's n best beams, searched before any is
    answered; rendered, streamed and counted as any choices are."""

    def __init__(self, *args, eos_token_id: int | None, ignore_eos: bool,
                 length_penalty: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eos_token_id, self.ignore_eos = eos_token_id, ignore_eos
        self.length_penalty = length_penalty
        self.outputs: list[Generation] = []
        self.seconds = 0.0  # the search's

    def params(self, request: Request) -> BeamParams:
        sampling = request.sampling
        return BeamParams(self.plan.n, sampling.max_tokens, self.eos_token_id,
                          self.ignore_eos, self.length_penalty,
                          sampling.include_stop_str_in_output, sampling.logprobs or 0)

    async def all_choices(self, run):
        """Each prompt searched (concurrently), then run(index) for every choice."""
        started, n = time.monotonic(), self.plan.n
        verifier = self.pools[1]
        found = await all_or_none(BeamSearch(request, self.params(request)).run(verifier)
                                  for request in self.plan.prompt_requests())
        self.seconds = time.monotonic() - started
        self.outputs = [self.generation(p * n + i, beam)
                        for p, beams in enumerate(found) for i, beam in enumerate(beams)]
        if len(self.outputs) != len(self.plan.choices):
            raise ValueError("the beam search found fewer beams than n")
        return await super().all_choices(run)

    def generation(self, index: int, beam: Beam) -> Generation:
        """Choice `index`'s output: the beam; its text without an ending EOS (vLLM's)."""
        request = self.plan.choices[index].request
        ended = beam.finish_reason == "stop"
        eos_kept = ended and bool(beam.tokens) and beam.tokens[-1] == self.eos_token_id
        top_n = request.sampling.logprobs
        logprobs = [] if top_n is None else beam.token_logprobs(top_n)
        return Generation(request, self.decode).settle(
            beam.tokens, logprobs, beam.finish_reason or "length",
            self.eos_token_id if ended else None, len(beam.tokens) - eos_kept)

    async def run_choice(self, index: int, on_text) -> Generation:
        """Choice `index`'s searched output, its whole text one delta."""
        generation = self.outputs[index]
        await on_text(generation, generation.text)
        self.metrics.record_choice(generation.state, self.plan.prompt_tokens(index),
                                   self.seconds, self.seconds)
        return generation
