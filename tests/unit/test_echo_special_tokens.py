"""The completions API's echo with logprobs of prompts that hold special tokens, through the
router's request path (test_prompt_answers' scripted pools) on the demo pair's tokenizer:
the prompt's tokens and the output's join into the choice's text and each text offset is
where its token's text starts, whole and streamed. A text holding `<|endoftext|>` is
tokenized to that special token, which reads as its text there; token ids are echoed as
skip_special_tokens decodes them; an id the tokenizer adds around a text (a BOS) reads ""."""

import pytest
from tokenizers.processors import TemplateProcessing

from deployments.prompts import PromptReader
from engine.models import DEMO_TARGET, load_tokenizer
from speculative.driver import text_decoder
from speculative.frontend import RequestFrontEnd, joined
from speculative.sampling import SamplingParams
from tests.unit.test_prompt_answers import Scored, served

END = "<|endoftext|>"  # the demo tokenizer's one special token, id 0


def with_bos():
    """The demo tokenizer adding its special token before every text, as a BOS."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{END} $A", special_tokens=[(END, 0)])
    return tokenizer


@pytest.fixture(scope="module", params=["demo", "with BOS"])
def tokenizer(request):
    return load_tokenizer(DEMO_TARGET) if request.param == "demo" else with_bos()


def tokenized(tokenizer):
    """served() with the tokenizer's prompts, decodes and added ids (Router's, PromptReader's);
    the output is token 1 ("!") each time."""
    serve = served(Scored())
    router = serve.router
    router.decode = router.tool_decode = text_decoder(tokenizer)
    router.special_decode = text_decoder(tokenizer, skip_special=False)
    reader = PromptReader.__new__(PromptReader)  # its probe of the ids added around a text
    reader.tokenizer = tokenizer
    router.prompts.added_around = reader.added_around

    async def plan(body, chat):
        ids = [tokenizer(p, add_special_tokens=body.add_special_tokens)["input_ids"]
               if isinstance(p, str) else p for p in body.prompts()]
        plans = [RequestFrontEnd().plan(f"cmpl-x-{i}", tuple(prompt), SamplingParams(
            temperature=0.0, max_tokens=body.max_tokens_or(4), logprobs=body.logprobs))
            for i, prompt in enumerate(ids)]
        return plans[0] if len(plans) == 1 else joined("cmpl-x", plans)

    router.plan = plan
    return serve


def echoed(tokenizer, body: dict) -> tuple[str, dict]:
    """The choice's text and logprobs, a stream's chunks joined."""
    status, answer = tokenized(tokenizer)({"max_tokens": 4, "echo": True, "logprobs": 1,
                                           **body})
    assert status == 200
    if not body.get("stream"):
        [choice] = answer["choices"]
        return choice["text"], choice["logprobs"]
    chunks = [e["choices"][0] for e in answer if e["choices"]]
    logged = [c["logprobs"] for c in chunks if c["logprobs"]]
    return "".join(c["text"] or "" for c in chunks), \
        {key: [v for chunk in logged for v in chunk[key]] for key in logged[0]}


def assert_joined(text: str, logprobs: dict, prompt_text: str, prompt_tokens: int) -> None:
    """The tokens join into the text, the prompt's into its echo, each offset where its
    token's text starts."""
    tokens = logprobs["tokens"]
    assert "".join(tokens) == text
    assert "".join(tokens[:prompt_tokens]) == prompt_text
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt", [f"{END}def f", f"x{END}y", "def f"])
def test_a_text_prompts_echo_reads_its_special_tokens_as_their_text(tokenizer, prompt, skip,
                                                                    stream):
    """The echoed text is the prompt as sent, so its special token reads as its text
    (whatever skip_special_tokens says of the output) and a BOS the tokenizer added reads "";
    the output's offsets count from the echo's end."""
    text, logprobs = echoed(tokenizer, {"prompt": prompt, "skip_special_tokens": skip,
                                        "stream": stream})
    ids = tokenizer(prompt)["input_ids"]
    assert text == prompt + "!" * 4
    assert_joined(text, logprobs, prompt, len(ids))
    own = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    added = [""] * (len(ids) - len(own))
    assert logprobs["tokens"][:len(ids)] == added + [tokenizer.decode([i]) for i in own]
    assert logprobs["tokens"][len(ids):] == ["!"] * 4
    assert logprobs["token_logprobs"][0] is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_prompts_echo_without_added_tokens_reads_every_id(stream):
    """add_special_tokens false: no BOS added, none read ""."""
    prompt = f"x{END}y"
    text, logprobs = echoed(with_bos(), {"prompt": prompt, "add_special_tokens": False,
                                         "stream": stream})
    assert logprobs["tokens"] == ["x", END, "y"] + ["!"] * 4
    assert_joined(text, logprobs, prompt, 3)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_an_id_prompts_echo_keeps_its_special_tokens_as_skip_special_tokens_says(skip,
                                                                                 stream):
    """Token ids are echoed in the text skip_special_tokens decodes them to, as the output
    is: false, the special ids' texts appear in the echo and its tokens."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    ids = tokenizer(f"{END}def f{END}x", add_special_tokens=False)["input_ids"]
    assert ids.count(0) == 2
    text, logprobs = echoed(tokenizer, {"prompt": ids, "skip_special_tokens": skip,
                                        "stream": stream})
    prompt_text = "def fx" if skip else f"{END}def f{END}x"
    assert text == prompt_text + "!" * 4
    assert_joined(text, logprobs, prompt_text, len(ids))
    assert logprobs["tokens"][0] == ("" if skip else END)
