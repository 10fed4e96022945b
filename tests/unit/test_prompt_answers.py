"""The router's answers with a prompt's logprobs (vLLM's prompt_logprobs) and the echo, over
scripted pools: the completions API's echo, whole and streamed, of a batch and by token id,
a chat's prompt logprobs and echo, and a prompt scoring that fails or whose client left."""

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest

from deployments.admission import Admission
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.prompt_logprobs import Echo, PromptAnswer
from deployments.router import Router
from speculative.frontend import RequestFrontEnd, joined
from speculative.sampling import SamplingParams
from speculative.types import PositionLogprobs, PromptLogprobs, TargetScores, TokenLogprob
from tests.tiny import Agreeing
from tests.unit.test_router_parts import Recorded, posted


class Scored(Agreeing):
    """Agreeing pools whose verifier gives logprobs: each output token's -0.5 (top: token 1),
    and each prompt token's -1.0 at rank 2, its top n tokens 9, 10, ... at -0.1, -0.2, ..."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[int], int]] = []

    async def score(self, call):
        k = len(call.draft_token_ids)
        return TargetScores(target_token_ids=(1,) * (k + 1), logprobs=PositionLogprobs(
            (-0.5,) * k, (-0.5,) * (k + 1), (((1, -0.5),),) * (k + 1)))

    async def prompt_logprobs(self, request_id, token_ids, top_n):
        self.asked.append((request_id, list(token_ids), top_n))
        top = tuple((9 + i, -0.1 * (i + 1)) for i in range(top_n))
        return PromptLogprobs(tuple(TokenLogprob(t, -1.0, top) for t in token_ids[1:]),
                              (2,) * (len(token_ids) - 1))


def served(verifier: Scored):
    """The Router's request path over Scored pools: every text prompt is tokens (2, 3) (token
    ids: their own), every token's text "a" ("s" with special tokens: a text prompt's, read
    as the text it echoes), the tokenizer adding none around a text, the body's max tokens
    of output (4 by default), greedy, logprobs as the body asks."""
    async def plan(body, chat):
        plans = [RequestFrontEnd().plan(f"cmpl-x-{i}", (2, 3) if isinstance(p, str) else p,
                                        SamplingParams(temperature=0.0,
                                                       max_tokens=body.max_tokens_or(4),
                                                       logprobs=body.top_logprobs_asked()),
                                        n=body.n)
                 for i, p in enumerate(["chat"] if chat else body.prompts())]
        return plans[0] if len(plans) == 1 else joined("cmpl-x", plans)

    router = SimpleNamespace(
        api_key=None, token_bytes=None, admission=Admission(16), metrics=Recorded(),
        args=SimpleNamespace(max_prompt_bytes=1 << 16, served_model_name="m",
                             reasoning_parser=None),
        decode=lambda ids: "a" * len(ids), tool_decode=lambda ids: "a" * len(ids),
        special_decode=lambda ids: "s" * len(ids), think_tokens=None,
        prompts=SimpleNamespace(reported_stop_ids=lambda body: (), added_around=([], [])),
        rendering=None, responses_store=None, pools=lambda kind=None: (Agreeing(), verifier),
        plan=plan,
        tool_use=lambda body: asyncio.sleep(0), reasoning=lambda body, plan: None)  # no tools
    router.prompt_answer = lambda body, plan, chat: Router.prompt_answer(router, body, plan, chat)
    router.choices = lambda *args: Router.choices(router, *args)

    def serve(body: dict, chat: bool = False):
        async def main():
            answer = await Router.serve_request(router, posted(body), ChatCompletionRequest
                                                if chat else CompletionRequest)
            if not body.get("stream"):
                return answer.status_code, json.loads(answer.body)
            return answer.status_code, [json.loads(c[len("data: "):]) async for c in
                                        answer.body_iterator if c != "data: [DONE]\n\n"]
        return asyncio.run(main())

    serve.router = router
    return serve


def test_an_echo_puts_the_prompt_before_the_output_with_its_logprobs():
    """OpenAI's echo with logprobs (as lm-evaluation-harness asks it): the prompt's text
    and tokens before the output's, the first token's logprob and top logprobs null, the
    text offsets running on from the prompt's tokens into the output's; vLLM's
    prompt_logprobs beside it."""
    verifier = Scored()
    status, body = served(verifier)({"prompt": "hi", "max_tokens": 4, "echo": True,
                                     "logprobs": 1, "prompt_logprobs": 2})
    assert status == 200
    [choice] = body["choices"]
    assert choice["text"] == "hi" + "aaaa"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["s"] * 2 + ["a"] * 4  # a text's, special tokens kept
    assert logprobs["token_logprobs"] == [None, -1.0] + [-0.5] * 4
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"s": -0.1}  # its top 1's text, before its own
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert choice["prompt_logprobs"] == [None, {
        "9": {"logprob": -0.1, "rank": 1, "decoded_token": "s"},
        "10": {"logprob": -0.2, "rank": 2, "decoded_token": "s"},
        "3": {"logprob": -1.0, "rank": 2, "decoded_token": "s"}}]
    assert verifier.asked == [("cmpl-x-0-prompt-0", [2, 3], 2)]


def test_each_prompt_of_a_batch_is_scored_once_for_its_n_choices():
    verifier = Scored()
    status, body = served(verifier)({"prompt": ["hi", "ho"], "n": 2, "max_tokens": 4,
                                     "echo": True})
    assert status == 200
    assert [c["text"] for c in body["choices"]] == ["hiaaaa"] * 2 + ["hoaaaa"] * 2
    _, body = served(verifier)({"prompt": [7, 8, 9], "max_tokens": 4, "echo": True})
    assert body["choices"][0]["text"] == "aaa" + "aaaa"  # token ids: their text
    assert all(c["logprobs"] is None and "prompt_logprobs" not in c for c in body["choices"])
    assert verifier.asked == []  # an echo without logprobs asks the verifier nothing
    status, body = served(verifier)({"prompt": ["hi", "ho"], "n": 2, "max_tokens": 4,
                                     "prompt_logprobs": 0})
    assert [len(c["prompt_logprobs"]) for c in body["choices"]] == [2] * 4
    assert [call[0] for call in verifier.asked] == ["cmpl-x-prompt-0", "cmpl-x-prompt-1"]


def test_a_chats_prompt_logprobs_are_on_its_response():
    verifier = Scored()
    status, body = served(verifier)({"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4, "n": 3, "prompt_logprobs": 1}, chat=True)
    assert status == 200
    assert body["prompt_logprobs"] == [None, {
        "9": {"logprob": -0.1, "rank": 1, "decoded_token": "s"},
        "3": {"logprob": -1.0, "rank": 2, "decoded_token": "s"}}]
    assert len(verifier.asked) == 1


def test_a_streamed_echo_sends_the_prompt_first_and_its_offsets_run_on():
    verifier = Scored()
    status, events = served(verifier)({"prompt": "hi", "max_tokens": 4, "echo": True,
                                       "logprobs": 0, "stream": True})
    assert status == 200
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["text"] == "hi"
    assert chunks[0]["logprobs"]["token_logprobs"] == [None, -1.0]
    assert "".join(c["text"] for c in chunks) == "hiaaaa"
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_names_the_prompts_tokens_by_id_as_the_outputs(stream):
    """vLLM's return_tokens_as_token_ids with echo: the prompt's tokens (the first too) and
    their top ones are "token_id:<id>" as the output's are, whole and streamed; the offsets
    still count the texts (the prompt's tokens were shown as text, the output's by id)."""
    verifier = Scored()
    status, answer = served(verifier)({"prompt": "hi", "max_tokens": 4, "echo": True,
                                       "logprobs": 1, "return_tokens_as_token_ids": True,
                                       "stream": stream})
    assert status == 200
    chunks = [e["choices"][0]["logprobs"] for e in answer if e["choices"]] if stream else \
        [answer["choices"][0]["logprobs"]]
    logprobs = {key: [v for c in chunks if c for v in c[key]] for key in chunks[0]}
    assert logprobs["tokens"] == ["token_id:2", "token_id:3"] + ["token_id:1"] * 4
    assert logprobs["top_logprobs"][:2] == [None, {"token_id:9": -0.1, "token_id:3": -1.0}]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert not stream or chunks[0]["tokens"] == ["token_id:2", "token_id:3"]  # the prompt's


def test_an_echo_of_a_prompt_ending_inside_a_character_joins_into_its_text():
    """A prompt of token ids may end inside a UTF-8 character (its echoed text: a U+FFFD
    there): its last token carries it, so that the prompt's tokens join into the echoed
    text and the output's offsets start where the output's text does."""
    pieces = {1: b"a", 7: b"\xc3"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    async def main():
        echoed = []
        for ids in ([1, 7], [7]):
            answer = PromptAnswer(Scored(), "r", [ids], None, [Echo(decode(ids), decode)], 0,
                                  decode)
            echoed.append((decode(ids), *answer.echo_logprobs(0, await answer.ready())))
        return echoed

    for text, logprobs, length in asyncio.run(main()):
        assert text.endswith("\ufffd")
        assert "".join(logprobs["tokens"]) == text and length == len(text)


def test_a_stream_whose_client_left_before_its_first_chunk_leaves_no_prompt_call():
    """A stream's events never ran (its client gone before the first chunk: the generator
    closed unstarted, which runs no `finally`): no prompt logprobs call of its runs on."""
    class Pending(Scored):
        running = 0

        async def prompt_logprobs(self, request_id, token_ids, top_n):
            Pending.running += 1
            try:
                await asyncio.Event().wait()
            finally:
                Pending.running -= 1

    serve = served(Pending())

    async def main():
        answer = await Router.serve_request(serve.router, posted(
            {"prompt": ["hi", "ho"], "max_tokens": 4, "echo": True, "logprobs": 1,
             "stream": True}), CompletionRequest)
        await asyncio.sleep(0.01)
        await answer.body_iterator.aclose()  # as ReleasingStream ends it
        answer.ticket.release()
        await asyncio.sleep(0.01)
        return Pending.running

    assert asyncio.run(main()) == 0


def test_a_failed_prompt_scoring_fails_the_request_with_the_pools_error():
    from deployments.replica_stream import PoolError

    class Failing(Scored):
        async def prompt_logprobs(self, request_id, token_ids, top_n):
            raise PoolError("verifier", grpc.StatusCode.UNAVAILABLE, "gone")

    status, body = served(Failing())({"prompt": "hi", "max_tokens": 4, "prompt_logprobs": 1})
    assert status >= 500 and "verifier" in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chats_echo_puts_the_last_messages_text_before_each_choices_content(stream):
    """vLLM's chat echo: the last message's text, when its role is the reply's (the
    assistant's a client began; without the generation prompt, the last message's own),
    before each choice's content (streamed: on the first chunk, with the role); nothing
    otherwise, and the verifier is asked nothing."""
    verifier, serve = Scored(), None
    began = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    cases = [({"messages": began, "continue_final_message": True,
               "add_generation_prompt": False}, "Sure: "),
             ({"messages": began[:1], "add_generation_prompt": False}, "hi"),
             ({"messages": began[:1]}, "")]
    for fields, echoed in cases:
        serve = served(verifier)
        status, answer = serve({**fields, "max_tokens": 4, "n": 2, "echo": True,
                                "stream": stream}, chat=True)
        assert status == 200
        if stream:
            chunks = [e["choices"][0] for e in answer if e["choices"]]
            contents = ["".join(c["delta"].get("content") or "" for c in chunks
                                if c["index"] == i) for i in range(2)]
            assert chunks[0]["delta"]["role"] == "assistant"
            assert chunks[0]["delta"]["content"] == echoed
        else:
            contents = [c["message"]["content"] for c in answer["choices"]]
        assert contents == [echoed + "aaaa"] * 2
    assert verifier.asked == []
