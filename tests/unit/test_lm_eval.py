"""lm-evaluation-harness against the router, as a vLLM user points it there: the bodies its
`local-completions` and `local-chat-completions` models send (lm_eval/models/
openai_completions.py, `_create_payload`), through the Router's request path, and the
answers read where its `parse_logprobs` and `parse_generations` read them."""

import pytest

from speculative.types import PromptLogprobs, TokenLogprob
from tests.unit.test_prompt_answers import Scored, served

SEED = 1234  # lm-eval's default, sent with every body


def loglikelihood_body(prompts: list[list[int]]) -> dict:
    """What local-completions sends for a batch of loglikelihood requests: each prompt the
    context's and the continuation's token ids, echoed with one top logprob."""
    return {"model": "m", "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": SEED, "echo": True}


def read_logprobs(body: dict, ctxlens: list[int]) -> list[tuple[list[float], bool]]:
    """(the continuation's logprobs, is_greedy) of each prompt, as lm-eval reads them: the
    choices by `index`, token_logprobs[ctxlen:-1] (the last, the output's token, dropped),
    greedy where each equals the largest of its position's top_logprobs."""
    read = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        read.append((logprobs, all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    return read


class Likeliest(Scored):
    """Scored, but each prompt token is its position's likeliest (a greedy continuation)."""

    async def prompt_logprobs(self, request_id, token_ids, top_n):
        self.asked.append((request_id, list(token_ids), top_n))
        return PromptLogprobs(tuple(TokenLogprob(t, -1.0, ((t, -1.0),)) for t in token_ids[1:]),
                              (1,) * (len(token_ids) - 1))


@pytest.mark.parametrize("verifier, greedy", [(Scored, False), (Likeliest, True)])
def test_a_loglikelihood_batch_is_answered_where_lm_eval_reads_it(verifier, greedy):
    """A batch of token-id prompts of different lengths: one choice each, in order, its
    prompt's tokens then the one output token, so that token_logprobs[ctxlen:-1] holds the
    continuation's, each position's top_logprobs with the chosen token and the likeliest."""
    verifier = verifier()
    prompts, ctxlens = [[5, 6, 7, 8, 9], [10, 11, 12]], [3, 1]
    status, body = served(verifier)(loglikelihood_body(prompts))
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [len(c["logprobs"]["token_logprobs"]) for c in body["choices"]] == [6, 4]
    assert read_logprobs(body, ctxlens) == [([-1.0] * 2, greedy), ([-1.0] * 2, greedy)]
    assert [ids for _, ids, _ in verifier.asked] == prompts  # each prompt scored, as sent


HUMANEVAL_UNTIL = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def test_generate_until_takes_a_tasks_stop_strings_and_the_end_text():
    """local-completions sends a task's `until` and the tokenizer's end text as `stop`,
    untruncated (humaneval's: six; vLLM bounds none), by batches of token-id prompts;
    local-chat-completions cuts them to OpenAI's four."""
    stop = [*HUMANEVAL_UNTIL, "<|endoftext|>"]
    status, body = served(Scored())({"prompt": [[5, 6], [7]], "model": "m", "max_tokens": 3,
                                     "temperature": 0, "stop": stop, "seed": SEED})
    assert status == 200, body
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "aaa"), (1, "aaa")]
    status, body = served(Scored())({"messages": [{"role": "user", "content": "hi"}],
                                     "model": "m", "max_tokens": 3, "temperature": 0,
                                     "stop": stop[:4], "seed": SEED}, chat=True)
    assert status == 200 and body["choices"][0]["message"]["content"] == "aaa"


class Undecoded(Likeliest):
    """Likeliest, recording every call of the decoding (a draft, a verification, a
    release) as both pools."""

    def __init__(self) -> None:
        super().__init__()
        self.decoding: list[str] = []

    async def propose(self, call):
        self.decoding.append("propose")
        return await super().propose(call)

    async def score(self, call):
        self.decoding.append("score")
        return await super().score(call)

    async def release(self, request_id):
        self.decoding.append("release")


@pytest.mark.parametrize("stream", [False, True])
def test_an_older_harness_loglikelihood_of_no_tokens_is_the_prompt_alone(stream):
    """lm-eval <= 0.4.3 sends max_tokens 0 with echo and reads token_logprobs[ctxlen:]: each
    choice is its prompt alone (its text, its tokens' logprobs, the first null), ended
    "length" with no output token, whole or streamed, and nothing is drafted or verified
    (the prompt's logprobs are the one call). Without echo, 0 is refused, as vLLM's."""
    verifier = Undecoded()
    serve = served(verifier)
    serve.router.pools = lambda kind=None: (verifier, verifier)
    prompts, ctxlens = [[5, 6, 7, 8, 9], [10, 11, 12]], [3, 1]
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    status, answer = serve({**loglikelihood_body(prompts), "max_tokens": 0, **options})
    assert status == 200
    if stream:  # each choice's chunks joined, the usage on the last event
        events, body = answer, {"usage": answer[-1]["usage"], "choices": []}
        for index in (0, 1):
            chunks = [e["choices"][0] for e in events if e["choices"]
                      and e["choices"][0]["index"] == index]
            body["choices"].append({
                "index": index, "text": "".join(c["text"] or "" for c in chunks),
                "finish_reason": chunks[-1]["finish_reason"],
                "logprobs": {key: [v for c in chunks if c["logprobs"]
                                   for v in c["logprobs"][key]]
                             for key in ("token_logprobs", "top_logprobs")}})
    else:
        body = answer
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [("aaaaa", "length"), ("aaa", "length")]
    assert [c["logprobs"]["token_logprobs"] for c in body["choices"]] == \
        [[None] + [-1.0] * 4, [None] + [-1.0] * 2]
    assert [(sum(lps), greedy) for lps, greedy in read_older(body, ctxlens)] == \
        [(-2.0, True), (-2.0, True)]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 8
    assert verifier.decoding == [] and [ids for _, ids, _ in verifier.asked] == prompts
    status, refused = serve({"prompt": "hi", "max_tokens": 0})
    assert status == 400 and refused["error"]["param"] == "max_tokens"


def read_older(body: dict, ctxlens: list[int]) -> list[tuple[list[float], bool]]:
    """(the continuation's logprobs, is_greedy) as lm-eval <= 0.4.3 read them: all of
    token_logprobs[ctxlen:], no output token after them."""
    read = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:]
        read.append((logprobs, all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    return read
