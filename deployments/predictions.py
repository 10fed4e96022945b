"""OpenAI's Predicted Outputs on chat completions: `prediction`, text a client expects most of
the answer to repeat (a file being edited). The router reads it into token ids that its
prompt-lookup drafter searches before the context (drafter.ngram): a free draft, verified as
any, so the answer stays the model's own. Usage then counts the prediction's tokens the
answer repeated (`accepted_prediction_tokens`) and the rest (`rejected_prediction_tokens`).
"""

import asyncio
from collections import Counter
from difflib import Match, SequenceMatcher
from itertools import accumulate
from typing import Literal

from pydantic import BaseModel, field_validator

from deployments.tools import FieldError

SHAPE = ('must be {"type": "content", "content": a string or a list of {"type": "text", '
         '"text": a string} parts}')
# a diff of at most this many (prediction x output) ids beyond their common start and end is
# exact (difflib's without its junk heuristic, about 0.05 s for 2k x 2k ids of text); a
# longer one takes the heuristic (popular ids then match only within longer runs: a lower
# bound), which keeps 16k x 16k ids under 0.1 s where the exact diff took 13-25 s
MAX_EXACT_DIFF = 1 << 22
# the most pairs of equal (prediction, output) ids the diff compares in all (about 4 s on
# a 2-core VM): difflib's recursion compares a range's pairs again at each depth, so one
# id repeated against an output holding it every other id took 93 s for 2k x 2k ids, and
# against 16k text-like ids holding it 160 times 24 s; past it the blocks found so far (a
# lower bound; 64k text-like ids with 2 % edited: about half)
MAX_DIFF_PAIRS = 1 << 25


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's `prediction` (checked by `checked_prediction` first: a refusal names it)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        """The predicted text: the content, or its parts' texts one after the other."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class PredictionField(BaseModel):
    """A request's `prediction` (a base of the chat's and, as an extension, the completion's
    request: OpenAI's and vLLM's completions have none)."""

    # OpenAI's Predicted Outputs: text the answer is expected to repeat, a draft source
    prediction: Prediction | None = None

    @field_validator("prediction", mode="before")
    @classmethod
    def prediction_shape(cls, value):
        return checked_prediction(value)


def checked_prediction(value):
    """The body's `prediction` as given, None where its content is empty (no prediction);
    a FieldError naming it for any other shape than OpenAI's."""
    if value is None or isinstance(value, Prediction):  # (a body built in Python)
        return value
    if not isinstance(value, dict) or value.get("type") != "content":
        raise FieldError("prediction", SHAPE)
    content = value.get("content")
    if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and
            isinstance(part.get("text"), str) for part in content):
        text = "".join(part["text"] for part in content)
    elif isinstance(content, str):
        text = content
    else:
        raise FieldError("prediction", SHAPE)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError("prediction", "contains text that is not valid Unicode (a lone "
                                       "surrogate?)") from None
    return value if text else None


def predicted_ids(tokenizer, text: str, max_bytes: int, max_tokens: int) -> tuple[int, ...]:
    """The prediction's ids (no special tokens: a special token's text is text), refused (a
    400 naming it) beyond max_bytes before tokenizing, and beyond max_tokens (the context:
    an answer holds no more)."""
    from deployments.ingress import BadRequest  # (Ray's and FastAPI's: not for the body)

    size = len(text.encode())
    if size > max_bytes:
        raise BadRequest(f"prediction has {size} bytes; the limit is {max_bytes}",
                         param="prediction")
    # a special token's text read as text, as a message's is (deployments.special_texts):
    # the answer writes it so; its id would be a draft no answer repeats
    ids = tuple(tokenizer(text, add_special_tokens=False, split_special_tokens=True
                          )["input_ids"])
    if len(ids) > max_tokens:
        raise BadRequest(f"prediction has {len(ids)} tokens; the limit is {max_tokens} (the "
                         "context)", param="prediction")
    return ids


class PredictionReader:
    """A prompt reader's predictions read into ids (off the event loop, on its tokenizing
    executor), the last one kept: each prompt of a completions batch and each conversation
    of a chat batch reads the body's one (128 of them tokenized it 128 times, each Request
    holding its own ids: 0.7 s and 4.6 MB a 128k-token prediction)."""

    def __init__(self, tokenizing, tokenizer, max_bytes: int, max_tokens: int) -> None:
        self.tokenizing, self.tokenizer = tokenizing, tokenizer
        self.max_bytes, self.max_tokens = max_bytes, max_tokens
        self.last: tuple[str, tuple[int, ...]] = ("", ())

    async def ids(self, prediction: Prediction) -> tuple[int, ...]:
        """The prediction's ids (predicted_ids')."""
        text = prediction.text
        if text == self.last[0]:
            return self.last[1]
        ids = await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, predicted_ids, self.tokenizer, text, self.max_bytes,
            self.max_tokens)
        self.last = text, ids
        return ids


def accepted_prediction_tokens(prediction: tuple[int, ...], output: list[int]) -> int:
    """The prediction's ids that the output repeats: their common start and end, and the
    sizes of the matching blocks of a diff of what lies between (difflib's)."""
    most = min(len(prediction), len(output))
    head = next((i for i in range(most) if prediction[i] != output[i]), most)
    tail = next((i for i in range(most - head) if prediction[-1 - i] != output[-1 - i]),
                most - head)
    inner = prediction[head:len(prediction) - tail], output[head:len(output) - tail]
    if not inner[0] or not inner[1]:
        return head + tail
    matcher = BoundedMatcher(*inner, autojunk=len(inner[0]) * len(inner[1]) > MAX_EXACT_DIFF)
    return head + tail + sum(block.size for block in matcher.get_matching_blocks())


class BoundedMatcher(SequenceMatcher):
    """difflib's diff of two id sequences that compares at most MAX_DIFF_PAIRS pairs of
    equal ids: a range whose longest match could compare more is left without one."""

    def __init__(self, a, b, autojunk: bool) -> None:
        super().__init__(None, a, b, autojunk)
        b2j, counts = self.b2j, Counter(a)  # the output's ids' places, junk left out
        # find_longest_match over a[alo:ahi], b[blo:bhi] compares at most the pairs of a
        # prediction id there with its places in the output (those before bhi)
        self.in_a = [0, *accumulate(len(b2j.get(t, ())) for t in a)]
        self.in_b = [0, *accumulate(counts[t] if t in b2j else 0 for t in b)]
        self.left = MAX_DIFF_PAIRS

    def find_longest_match(self, alo=0, ahi=None, blo=0, bhi=None):
        ahi, bhi = len(self.a) if ahi is None else ahi, len(self.b) if bhi is None else bhi
        cost = min(self.in_a[ahi] - self.in_a[alo], self.in_b[bhi])
        if cost > self.left:
            return Match(alo, blo, 0)
        self.left -= cost
        return super().find_longest_match(alo, ahi, blo, bhi)


def prediction_usage(prediction: tuple[int, ...], outputs: list[list[int]]) -> dict:
    """completion_tokens_details' counts of a prediction, each output (a choice's ids)
    counted against it and the counts summed, as the usage's tokens are."""
    accepted = sum(accepted_prediction_tokens(prediction, output) for output in outputs)
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(prediction) * len(outputs) - accepted}
