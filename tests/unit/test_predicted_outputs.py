"""OpenAI's Predicted Outputs (`prediction`, deployments.predictions): the field as OpenAI
takes it, read into token ids, planned onto the router's prompt lookup, and counted in the
usage (accepted_prediction_tokens, rejected_prediction_tokens)."""

import asyncio
import json
from types import MethodType, SimpleNamespace

import pytest
from starlette.requests import Request

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.ingress import BadRequest, parse
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.predictions import accepted_prediction_tokens, prediction_usage
from deployments.prompts import Prompt
from deployments.router import Router
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults
from speculative.sampling import SamplingParams
from tests.unit.test_router_parts import JSON_TYPE

CHAT = [{"role": "user", "content": "hi"}]


def chat_body(**fields) -> ChatCompletionRequest:
    body = json.dumps({"messages": CHAT, **fields}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [JSON_TYPE, (b"content-length", str(len(body)).encode())]}
    return asyncio.run(parse(Request(scope, receive), ChatCompletionRequest, 1 << 20))


def test_openais_shapes_of_a_prediction_are_taken():
    """A string, or text parts read one after the other; empty content is no prediction."""
    parts = [{"type": "text", "text": "def f"}, {"type": "text", "text": "(x):"}]
    assert chat_body(prediction={"type": "content", "content": "x = 1"}).prediction.text \
        == "x = 1"
    assert chat_body(prediction={"type": "content", "content": parts}).prediction.text \
        == "def f(x):"
    for empty in ("", [], [{"type": "text", "text": ""}]):
        assert chat_body(prediction={"type": "content", "content": empty}).prediction is None
    assert chat_body(prediction=None).prediction is None
    # the completions endpoint takes it too (an extension: OpenAI's and vLLM's have none)
    assert CompletionRequest(prompt="x", prediction={"type": "content", "content": "y"}
                             ).prediction.text == "y"
    with pytest.raises(ValueError, match="prediction"):
        CompletionRequest(prompt="x", prediction={"type": "x"})


@pytest.mark.parametrize("prediction", [
    "x = 1", {"content": "x"}, {"type": "text", "content": "x"}, {"type": "content"},
    {"type": "content", "content": 5}, {"type": "content", "content": [{"text": "x"}]},
    {"type": "content", "content": [{"type": "image_url", "image_url": "u"}]},
    {"type": "content", "content": [{"type": "text", "text": 5}]},
    {"type": "content", "content": "\ud800"}])
def test_any_other_prediction_is_a_400_naming_it(prediction):
    with pytest.raises(BadRequest) as refused:
        chat_body(prediction=prediction)
    assert refused.value.status == 400 and refused.value.param == "prediction"


@pytest.fixture(scope="module")
def reader():
    from deployments.prompts import PromptReader
    from deployments.router_args import RouterArgs
    from engine.checkpoint import Checkpoint
    from engine.models import load_tokenizer

    model = "models/demo/target"
    return PromptReader(RouterArgs(model=model, max_context_tokens=64),
                        load_tokenizer(model), Checkpoint.load(model))


def test_the_prompt_reader_tokenizes_a_prediction_within_the_context(reader):
    """Its ids without special tokens; longer than the context: a 400 naming it."""
    text = "def main():\n    return 1\n"
    prompt = asyncio.run(reader.read(chat_body(
        prediction={"type": "content", "content": text}), chat=True))
    assert prompt.prediction_ids == \
        tuple(reader.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert asyncio.run(reader.read(chat_body(), chat=True)).prediction_ids == ()
    with pytest.raises(BadRequest) as refused:
        asyncio.run(reader.read(chat_body(
            prediction={"type": "content", "content": text * 20}), chat=True))
    assert refused.value.param == "prediction" and "the limit is 64" in str(refused.value)


def test_a_special_tokens_text_in_a_prediction_is_read_as_text(reader):
    """"<|endoftext|>" in a prediction is the text's ids, as in a message: not the end
    token, which the answer writing that text never repeats."""
    text = "x = 1 <|endoftext|> y"
    prompt = asyncio.run(reader.read(chat_body(
        prediction={"type": "content", "content": text}), chat=True))
    assert prompt.prediction_ids == tuple(reader.tokenizer(
        text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    assert not set(prompt.prediction_ids) & set(reader.tokenizer.all_special_ids)


def test_a_batchs_prompts_read_the_bodys_prediction_once(reader, monkeypatch):
    """Each prompt of a completions batch (each conversation of a chat batch) reads the
    body's one prediction: tokenized once, its ids one tuple for them all."""
    from deployments import predictions

    calls = []
    monkeypatch.setattr(predictions, "predicted_ids",
                        lambda *args: calls.append(args) or (7, 8, 9))
    prediction = {"type": "content", "content": [{"type": "text", "text": "once "},
                                                 {"type": "text", "text": "only"}]}
    body = CompletionRequest(prompt=["a", "b", "c"], prediction=prediction)
    read = [asyncio.run(reader.read(body.model_copy(update={"prompt": p}), chat=False))
            for p in body.prompts()]
    read.append(asyncio.run(reader.read(chat_body(prediction=prediction), chat=True)))
    assert len(calls) == 1 and all(r.prediction_ids is read[0].prediction_ids for r in read)


def planned(front_end: RequestFrontEnd | None = None, **fields):
    """Router.plan_one over stand-ins: a prompt of two tokens predicting 5 6 7."""

    async def read(body, chat):
        return Prompt((2, 3), SamplingParams(temperature=0, max_tokens=4), (),
                      prediction_ids=(5, 6, 7) if body.prediction else ())

    router = SimpleNamespace(admission=Admission(8), check_model=lambda body: None,
                             front_end=front_end or RequestFrontEnd(),
                             prompts=SimpleNamespace(read=read, context_limit=64))
    router.plan_one = MethodType(Router.plan_one, router)
    return asyncio.run(Router.plan(router, ChatCompletionRequest(messages=CHAT, n=2, **fields),
                                   chat=True))


def test_a_prediction_drafts_with_prompt_lookup_unless_a_drafter_is_named():
    """No drafter named: the router's "ngram", each choice's Request with the ids, an
    adaptive K learning apart from prompt lookup without a prediction; a named drafter kept
    ("model": the pool's, None), the ids on the Request all the same."""
    prediction = {"type": "content", "content": "x"}
    front_end = RequestFrontEnd(SpeculationDefaults(num_speculative_tokens="auto"))
    plan = planned(front_end, prediction=prediction)
    assert plan.drafter_kind == "ngram" and list(front_end.costs) == [("ngram+prediction", True)]
    assert [c.request.prediction_token_ids for c in plan.choices] == [(5, 6, 7)] * 2
    assert planned(prediction=prediction, drafter="suffix").drafter_kind == "suffix"
    named = planned(prediction=prediction, drafter="model")
    assert named.drafter_kind is None and named.choices[0].request.prediction_token_ids
    unpredicted = planned()
    assert unpredicted.drafter_kind is None
    assert unpredicted.choices[0].request.prediction_token_ids == ()


def test_the_usage_counts_the_predictions_tokens_the_output_repeats():
    """A diff's matching blocks: 1 2 _ 4 of 1 2 3 4 repeated (3 accepted, 1 rejected);
    each choice counted against the prediction, the counts summed."""
    assert accepted_prediction_tokens((1, 2, 3, 4), [1, 2, 9, 4]) == 3
    assert accepted_prediction_tokens((1, 2, 3, 4), [7, 1, 2, 3, 4, 8]) == 4
    assert accepted_prediction_tokens((1, 2, 3, 4), []) == 0
    assert accepted_prediction_tokens((5, 1, 2, 6), [1, 2]) == 2
    assert prediction_usage((1, 2, 3, 4), [[1, 2, 9, 4], [4, 3]]) == {
        "accepted_prediction_tokens": 4, "rejected_prediction_tokens": 4}


def test_a_long_diff_stays_cheap_and_counts_a_lower_bound():
    """Beyond MAX_EXACT_DIFF ids between their common start and end (10k x 10k here) the
    diff takes difflib's heuristic, which still finds both edits of 20k ids."""
    prediction = tuple(i % 500 for i in range(20_000))
    output = list(prediction)
    output[5_000] = output[15_000] = 777
    assert accepted_prediction_tokens(prediction, output) == 19_998


def test_a_diff_compares_at_most_max_diff_pairs_pairs_of_ids(monkeypatch):
    """One id repeated against an output holding it every other id: difflib's recursion
    compared the pairs again at each depth (93 s for 2k x 2k ids on a 2-core VM, 3.1M
    pairs for 256 x 256 here); the diff stops at MAX_DIFF_PAIRS, a lower bound still."""
    from difflib import SequenceMatcher

    from deployments import predictions

    compared, find = [0], SequenceMatcher.find_longest_match

    def counted(self, alo=0, ahi=None, blo=0, bhi=None):
        compared[0] += sum(j < bhi for i in range(alo, ahi) for j in self.b2j.get(self.a[i], ()))
        return find(self, alo, ahi, blo, bhi)

    monkeypatch.setattr(SequenceMatcher, "find_longest_match", counted)
    monkeypatch.setattr(predictions, "MAX_DIFF_PAIRS", 20_000, raising=False)
    output = [0 if i % 2 == 0 else 1000 + i for i in range(256)]
    accepted = accepted_prediction_tokens((0,) * 256, output)
    assert compared[0] <= 20_000 and 0 < accepted <= 128
    compared[0] = 0  # an edited answer within the bound: counted whole
    assert accepted_prediction_tokens(tuple(range(300)), [*range(100), 7, *range(101, 300)]) \
        == 299 and compared[0] <= 20_000


def test_a_chats_usage_carries_the_prediction_counts_beside_its_reasoning_tokens():
    """Choices.usage (whole and the stream's usage chunk): completion_tokens_details with
    the counts; no prediction, no details (without a reasoning parser)."""
    def usage(prediction: tuple[int, ...], think_tokens=None) -> dict:
        request = SimpleNamespace(prediction_token_ids=prediction)
        plan = SimpleNamespace(choices=[SimpleNamespace(request=request)],
                               usage=lambda done: {"completion_tokens": 4})
        choices = SimpleNamespace(plan=plan, think_tokens=think_tokens, reasoning=None)
        return Choices.usage(choices, [SimpleNamespace(token_ids=[1, 2, 9, 4])])

    counts = {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}
    assert usage((1, 2, 3, 4))["completion_tokens_details"] == counts
    assert "completion_tokens_details" not in usage(())
    parser = SimpleNamespace(nested=True, count=lambda ids: 2)  # 2 of the 4: reasoning
    assert usage((1, 2, 3, 4), parser)["completion_tokens_details"] == \
        {"reasoning_tokens": 2, **counts}
    assert usage((), parser)["completion_tokens_details"] == {"reasoning_tokens": 2}
