"""Tiny randomly initialised causal LMs built from a config, for tests that need no language."""

import asyncio
import tracemalloc

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speculative.costs import CostModel, RoundCost
from speculative.driver import Generation
from speculative.fixed_k import FixedK
from speculative.state import Request
from speculative.policy import KBounds, k_policy
from speculative.sampling import SamplingParams
from speculative.types import DraftBlock, TargetScores


def tiny_llama(seed: int, *, vocab_size: int = 64, layers: int = 2, hidden: int = 32):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper than the default init, so distributions are not flat
        model.lm_head.weight.mul_(8.0)
    return model


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
        min_new_tokens=max_tokens, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def run(drafter, verifier, prompt, params: SamplingParams, k: int | str, request_id="r", stop=(),
        decode=None, pipelined: bool = False, tree_width: int = 1, tree_nodes: int = 0,
        confidence=None, costs=None, policy=None, plain_steps: int = 1,
        free_in_reasoning=(), prediction=()):
    """Decode one request in-process through the request driver; returns (output ids, state).

    k: a fixed K, or "auto" for an adaptive K in 1..8 (the K of each round varies);
    tree_width > 1: each round drafts a tree of that width, K deep, of tree_nodes nodes;
    confidence: the draft calls' draft_confidence ("auto": learnt, with an adaptive K, into
    `costs`, a CostModel shared with other runs, or a new one); policy: a K policy of the
    test's own instead; plain_steps: the tokens a round without a draft asks the verifier
    for (verifier.steps); free_in_reasoning: stop ids its reasoning ignores (Request's);
    prediction: the predicted output's ids (Request's prediction_token_ids).
    """
    request = Request(request_id, tuple(prompt), params, tuple(stop), tree_width=tree_width,
                      tree_nodes=tree_nodes, plain_steps=plain_steps,
                      free_in_reasoning=tuple(free_in_reasoning),
                      prediction_token_ids=tuple(prediction))
    generation = Generation(request, decode)
    asyncio.run(decoded(drafter, verifier, generation, k, pipelined, confidence, costs, policy))
    return generation.token_ids, generation.state


async def decoded(drafter, verifier, generation: Generation, k: int | str,
                  pipelined: bool = False, confidence=None, costs=None,
                  policy=None) -> Generation:
    """The generation run to its end under a fixed K or "auto" (adaptive in 1..8)."""
    greedy = generation.state.request.sampling.greedy
    policy = policy or k_policy(k, pipelined, greedy, KBounds(1, 8, initial=2), costs,
                                confidence=confidence)
    return await generation.run(drafter, verifier, policy, pipelined)


class DraftsFirst(FixedK):
    """A fixed K whose pipelined rounds without candidates draft first (as
    AdaptiveK.restarts_fresh chooses where a verify is dear against a draft), not fresh."""

    def restarts_fresh(self) -> bool:
        return False


class Agreeing:
    """A drafter and a verifier that always agree on token 1: every draft is accepted."""

    async def propose(self, call):
        return DraftBlock((1,) * call.num_speculative_tokens, None)

    async def score(self, call):
        return TargetScores(target_token_ids=(1,) * (len(call.draft_token_ids) + 1))

    async def release(self, request_id):
        pass


class Scripted:
    """A drafter and a verifier that follow one fixed output (greedy): the drafter proposes
    the script, wrong at every `miss`-th position, so rounds commit 1 to K + 1 tokens; after
    the output, token 0. prompt_len: the prompt's tokens before the output."""

    def __init__(self, output: list[int], miss: int = 3, prompt_len: int = 1) -> None:
        self.output, self.miss, self.prompt_len = output, miss, prompt_len

    def at(self, position: int) -> int:
        return self.output[position] if position < len(self.output) else 0

    async def propose(self, call):
        start = call.sync.committed_len - self.prompt_len
        ids = [self.at(p) if (p + 1) % self.miss else (self.at(p) + 1) % 3
               for p in range(start, start + call.num_speculative_tokens)]
        return DraftBlock(tuple(ids), None)

    async def score(self, call):
        start = call.sync.committed_len - self.prompt_len
        ids = [self.at(p) for p in range(start, start + len(call.draft_token_ids) + 1)]
        return TargetScores(target_token_ids=tuple(ids))

    async def release(self, request_id):
        pass


def cutting_costs() -> CostModel:
    """A router's costs that learnt to cut a draft block below a confidence of 0.3
    (speculative.confidence): a drafted token costs 4 ms (draft and verify slopes of 2 ms),
    so at the rate an adaptive K expects it pays only if accepted most of the time, and the
    tokens drafted after confidences under 0.3 never were."""
    costs = CostModel()
    for _ in range(50):
        costs.observe(RoundCost(5, 0.010, 4, 0.008, 0.001))
        costs.observe(RoundCost(3, 0.006, 2, 0.004, 0.001))
    for _ in range(200):
        costs.confidence.observe((0.9, 0.5, 0.25, 0.15, 0.05), 3)
    return costs


def noisy_copy(model, scale: float, seed: int):
    """A draft that agrees with `model` often but not always: its weights plus noise."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return draft


def tiny_sliding(seed: int, *, window: int = 8, vocab_size: int = 64, mixed: bool = False):
    """A Mistral-like model whose attention slides over `window` positions (mixed: a
    Qwen2-like stack that alternates sliding and full layers, as Gemma-2 does)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, sliding_window=window,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if mixed:
        config = Qwen2Config(**shape, use_sliding_window=True,
                             layer_types=["sliding_attention", "full_attention"])
        model = Qwen2ForCausalLM(config).eval()
    else:
        model = MistralForCausalLM(MistralConfig(**shape)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def word_tokenizer(words: list[str], pre_tokenizer, decoder, cleanup: bool = False):
    """A word-level tokenizer over `words` with the given pre-tokenizer and decoder
    (cleanup: transformers' clean_up_tokenization_spaces on the whole decoded text)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<eos>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizer, decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=cleanup)


class CodePointTokenizer:
    """A tokenizer's stand-in for code that only encodes: one id per character, its code
    point, over a vocabulary of 128."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def __len__(self) -> int:
        return 128


def char_tokenizer(letters: str):
    """One token per (ASCII) letter, ids 2.. after <eos> 0 and <unk> 1, byte-level as GPT-2's
    (what llguidance reads), for grammars over a tiny vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<eos>", "<unk>", *letters])}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                   unk_token="<unk>")


def rewriting_tokenizer():
    """Decoding a longer sequence rewrites earlier text: transformers' cleanup of the whole
    text turns "it '" into "it's" once an "s" follows (" ' " -> "'")."""
    from tokenizers import decoders, pre_tokenizers

    return word_tokenizer(["it", "'", "s", "a", "b", ",", "c", "d", "."],
                          pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(cleanup=False),
                          cleanup=True)


def metaspace_tokenizer():
    """SentencePiece-style: a word's leading space is part of its token and dropped when the
    decoded text starts with it."""
    from tokenizers import decoders, pre_tokenizers

    return word_tokenizer(["▁hello", "▁world", "▁again"], pre_tokenizers.Metaspace(),
                          decoders.Metaspace())


def byte_level_tokenizer(pieces: list[bytes]):
    """GPT-2 / Qwen-style byte-level BPE for token sequences picked by id: <eos> 0, byte b
    1 + b, then `pieces` from 257 on (tokens of several bytes, which may end inside a
    character or hold the end of one and the start of the next, as trained vocabularies do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    shown = {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}
    vocab = {"<eos>": 0, **{shown[b]: 1 + b for b in range(256)}}
    for piece in pieces:
        vocab["".join(shown[b] for b in piece)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def byte_fallback_tokenizer(pieces: list[str]):
    """Llama-2-style SentencePiece: "▁" stands for a space, a character the vocabulary lacks
    falls back to its UTF-8 bytes (<0xF0> tokens), and decoding drops the text's leading
    space. <s> 0, </s> 1, <unk> 2, byte b 3 + b, then `pieces` from 259 on."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in pieces:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


class Batched:
    """An engine behind the pools' continuous batcher, in-process: the rounds of all requests
    decoding concurrently on one event loop share forwards (tests of batching exactness)."""

    def __init__(self, engine, max_batch_size: int = 64) -> None:
        from deployments.batcher import ContinuousBatcher
        from engine.batch import UNFINISHED

        self.engine = engine
        self.batch_sizes: list[int] = []
        work = getattr(engine, "score_batch", None) or engine.propose_batch

        async def run_batch(calls):
            self.batch_sizes.append(len(calls))
            await asyncio.sleep(0)  # let the other requests queue behind this batch
            return work(calls)

        # a call of several steps (verifier.steps) runs again until its last, as in a pool
        self.batcher = ContinuousBatcher(run_batch, max_batch_size,
                                         lambda answer: answer is UNFINISHED)

    async def answer(self, call):
        result = await self.batcher.submit(call)
        if isinstance(result, Exception):
            raise result
        return result

    propose = score = answer

    async def release(self, request_id: str) -> None:
        await self.engine.release(request_id)

    def __getattr__(self, name: str):  # the engine's optional methods (types.Drafter)
        return getattr(self.engine, name)


def run_seeded(drafter, verifier, prompt, params: SamplingParams, k: int | str, samples: int,
               pipelined: bool = False, tree_width: int = 1, tree_nodes: int = 0,
               group: int = 100, context_limit: int | None = None, policy=None,
               plain_steps: int = 1):
    """Request i (its seed i, its id str(i)) for i in 0..samples-1, `group` of them decoding
    at once (the pools wrapped in `Batched` serve each group's rounds in shared forwards);
    yields each one's (output ids, state) in order. A caller may stop early between groups.
    policy: makes each request's K policy (None: k's); plain_steps: state.Request's."""
    from dataclasses import replace

    async def one(i):
        request = Request(str(i), tuple(prompt), replace(params, seed=i), (),
                          tree_width=tree_width, tree_nodes=tree_nodes,
                          context_limit=context_limit, plain_steps=plain_steps)
        generation = await decoded(drafter, verifier, Generation(request), k, pipelined,
                                   policy=policy and policy())
        return generation.token_ids, generation.state

    async def main(start):
        return await asyncio.gather(*(one(i) for i in range(start, min(start + group,
                                                                      samples))))

    for start in range(0, samples, group):
        yield from asyncio.run(main(start))


def run_concurrently(drafter, verifier, prompts, params: SamplingParams, k: int | str,
                     max_tokens: list[int] | None = None, pipelined: bool = False,
                     plain_steps: int = 1):
    """Decode every prompt at once through the request driver; returns each one's ids."""
    from dataclasses import replace

    async def one(i, prompt):
        p = params if max_tokens is None else replace(params, max_tokens=max_tokens[i])
        p = replace(p, seed=(params.seed or 0) + i) if params.seed is not None else p
        request = Request(f"r{i}", tuple(prompt), p, (), plain_steps=plain_steps)
        return (await decoded(drafter, verifier, Generation(request), k, pipelined)).token_ids

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def traced_peak(work):
    """(work(), the peak of the bytes Python allocated while it ran): a feed that copies what
    it holds shows as a peak of that size."""
    tracemalloc.start()
    try:
        return work(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
