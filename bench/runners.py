"""The ways `specserve bench` produces tokens: HF `generate` (the target alone, or assisted by the
draft), specserve's round loop in this process, and specserve served by Ray Serve over HTTP.
Each returns the new token ids and the seconds they took (and the round statistics, if any)."""

import asyncio
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.pairs import Pair
from speculative.stats import SpecStats


def sampling_kwargs(temperature: float) -> dict:
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def hf_generate(model, prompt_ids, max_tokens: int, temperature: float, seed: int,
                assistant=None, k: int = 0) -> tuple[list[int], float]:
    ids = torch.tensor([prompt_ids])
    extra = {}
    if assistant is not None:
        # transformers takes the block's length and its confidence cut from the assistant's
        # own generation_config: passed to generate(), every K ran the defaults (blocks of
        # up to 20 tokens, cut where the draft's confidence fell below 0.4)
        assistant.generation_config.update(num_assistant_tokens=k,
                                           num_assistant_tokens_schedule="constant",
                                           assistant_confidence_threshold=0.0)
        extra = {"assistant_model": assistant}
    torch.manual_seed(seed)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0,
                         **sampling_kwargs(temperature), **extra)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - started


@torch.no_grad()
def departs_at_tie(model, prompt_ids, reference, ids) -> bool:
    """Whether ids, another run's greedy tokens after prompt_ids, depart from the target's
    own (reference) first with a token whose logit there lies within one unit of rounding of
    the target's dtype of the reference's token: a tie that another batch's rounding may
    break either way (bf16's often: the scaled pair's top two were equal on 10 of 32 sweep
    prompts within 12 tokens, and its bf16 and fp32 greedy tokens differed on 5). Any other
    departure is a mismatch. The logits come from one forward of the prompt and the
    reference's tokens before the departure."""
    at = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), None)
    if at is None:  # one is a prefix of the other: a length, not a choice
        return False
    logits = model(input_ids=torch.tensor([[*prompt_ids, *reference[:at]]])).logits[0, -1]
    own, chosen = float(logits[reference[at]]), float(logits[ids[at]])
    unit = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(own), 1e-30)))
    return abs(own - chosen) <= unit


class InProcess:
    """The pair's models in this process: HF generate, assisted generation, our loop."""

    def __init__(self, pair: Pair, q_options: dict) -> None:
        from drafter.model import ModelDrafter
        from engine.models import load_causal_lm
        from verifier.engine import ModelVerifier

        self.target = load_causal_lm(pair.target, pair.target_dtype)
        self.draft = load_causal_lm(pair.draft, pair.draft_dtype)
        # q as the served drafter ships it (exact either way, but it changes α), and dense
        self.drafter = ModelDrafter(self.draft, **q_options)
        self.dense_drafter = ModelDrafter(self.draft)
        self.verifier = ModelVerifier(self.target)

    def loop(self, prompt_ids, max_tokens: int, temperature: float, seed: int, k: int,
             dense_q: bool = False):
        drafter = self.dense_drafter if dense_q else self.drafter
        return run_loop(drafter, self.verifier, prompt_ids, max_tokens, temperature, seed, k)


def run_loop(drafter, verifier, prompt_ids, max_tokens: int, temperature: float, seed: int,
             k: int | str, tree_width: int | str = 1, tree_nodes: int | None = None,
             front_end=None, prediction_ids=()):
    """(token ids, seconds, SpecStats) of one request through the round loop in this
    process, planned as the router plans an HTTP request with this seed (choice 0's derived
    seed: the same draws), at K (or "auto"), drafting then verifying (tree_width > 1: a tree
    of that width, K deep, of tree_nodes nodes; "auto": chain or tree per round).
    front_end: a RequestFrontEnd whose requests share what they learn (default: a new one
    for this request, with these settings); prediction_ids: a predicted output (OpenAI's
    `prediction`, which prompt lookup searches: drafter.ngram)."""
    from speculative.driver import Generation
    from speculative.frontend import RequestFrontEnd
    from speculative.options import SpeculationDefaults, TreeShape
    from speculative.sampling import SamplingParams

    front_end = front_end or RequestFrontEnd(SpeculationDefaults(num_speculative_tokens=k,
                                                                 pipelined_drafting="off"))
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
    plan = front_end.plan(uuid.uuid4().hex, tuple(prompt_ids), params,
                          tree=TreeShape(auto=True) if tree_width == "auto"
                          else TreeShape(tree_width, nodes=tree_nodes),
                          context_limit=verifier.max_positions,
                          prediction_token_ids=prediction_ids)
    [choice] = plan.choices
    generation = Generation(choice.request)
    started = time.perf_counter()
    asyncio.run(generation.run(drafter, verifier, choice.policy, plan.pipelined))
    return generation.token_ids, time.perf_counter() - started, generation.stats


class Served:
    """cluster/config.yaml on this process's Ray instance (free ports), serving one pair."""

    def __init__(self, draft_timeout_s: float | None = None) -> None:
        from deployments.local import app_config, load_config, on_free_ports, start_serve

        self.config = on_free_ports(load_config())
        if draft_timeout_s is not None:
            app_config(self.config, "router")["args"]["draft_timeout_s"] = draft_timeout_s
        self.url = f"http://127.0.0.1:{self.config['http_options']['port']}"
        start_serve(self.config)

    def use(self, pair: Pair) -> None:
        """Deploy the pair (the same apps and resources, other model paths)."""
        from deployments.local import app_config, deploy

        config = self.config
        app_config(config, "drafter")["args"].update(model=pair.draft, target=pair.target,
                                                     dtype=pair.draft_dtype)
        app_config(config, "verifier")["args"].update(model=pair.target, dtype=pair.target_dtype)
        app_config(config, "router")["args"].update(model=pair.target)
        deploy(config, timeout_s=300)

    def draft_q_options(self) -> dict:
        """The q options the drafter pool is configured with (top-k, mass, dtype), as set."""
        from deployments.local import app_config

        args = app_config(self.config, "drafter")["args"]
        return {name: args[name] for name in ("draft_top_k", "draft_q_mass", "draft_q_dtype")
                if name in args}

    def complete(self, prompt_ids, max_tokens: int, temperature: float, seed: int | None,
                 k: int | str, pipelined: bool | None = False):
        import requests

        body = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "num_speculative_tokens": k, "ignore_eos": True,
                "return_token_ids": True, "pipelined": pipelined}  # None: the router's default
        started = time.perf_counter()
        response = requests.post(self.url + "/v1/completions", json=body, timeout=600)
        seconds = time.perf_counter() - started
        response.raise_for_status()
        answer = response.json()
        return answer["choices"][0]["token_ids"], seconds, answer["speculative"]

    def concurrent(self, prompt_ids, max_tokens, temperature, seed, k, concurrency: int):
        with ThreadPoolExecutor(concurrency) as pool:
            started = time.perf_counter()
            results = list(pool.map(lambda i: self.complete(prompt_ids, max_tokens, temperature,
                                                            seed + i, k), range(concurrency)))
            return results, time.perf_counter() - started


def stats_from_http(spec: dict) -> SpecStats:
    """The round statistics of an HTTP answer's `speculative` object."""
    rounds, ms = spec["rounds"], spec["ms_per_round"] or {}
    seconds = lambda name: ms.get(name, 0) * rounds / 1000  # noqa: E731
    return SpecStats(
        rounds=rounds, num_drafts=spec["num_drafts"], num_draft_tokens=spec["num_draft_tokens"],
        num_accepted_tokens=spec["num_accepted_tokens"],
        num_emitted_tokens=spec["num_emitted_tokens"],
        plain_step_tokens=spec.get("plain_step_tokens", 0),  # no speculation's (tokens/round)
        draft_fallback_rounds=spec.get("draft_fallback_rounds", 0),
        accepted_per_position=list(spec["accepted_per_position"]),
        draft_compute_seconds=seconds("draft"), verify_compute_seconds=seconds("verify"),
        draft_seconds=seconds("draft") + seconds("transport"), verify_seconds=seconds("verify"),
        round_seconds=seconds("total"),
        wire_bytes=round((spec["wire_bytes_per_round"] or 0) * rounds))
