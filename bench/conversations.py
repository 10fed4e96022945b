"""Whether a conversation's later turns find their history cached: `serve run` of the
embedded config with two verifier replicas, conversations whose prompts share a hot system
prompt (their first 60 tokens) and grow turn by turn, all at once, once placed by the
prompt's start (under the bounded load, deployments.placement) and once with OpenAI's
`prompt_cache_key` naming each conversation; prints the share of the later turns' prompt
tokens the verifier took from its prefix cache (usage.prompt_tokens_details.cached_tokens).

    python -m bench.conversations            # ~3 minutes on 2 cores
"""

import argparse

import requests

from bench.newcomer import fresh_serve_run
from bench.spread import SHARED, all_at_once, config_with

TOKENS = 48  # each turn's output


def conversation(port: int, index: int, turns: int, keyed: bool, usages: list) -> None:
    """One conversation's turns in order, each prompt its history and a new line; each
    turn's (turn, prompt tokens, cached tokens) appended to `usages`."""
    history = SHARED + f"# conversation {index}\n"
    for turn in range(turns):
        history += f"def step_{index}_{turn}("
        body = {"prompt": history, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        if keyed:
            body["prompt_cache_key"] = f"conversation-{index}"
        answer = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                               timeout=600)
        answer.raise_for_status()
        answer = answer.json()
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        usages.append((turn, usage["prompt_tokens"], cached))
        history += answer["choices"][0]["text"] + "\n"


def run(conversations: int, turns: int, replicas: int, keyed: bool) -> dict:
    with fresh_serve_run(config_with(1.25, replicas)) as (port, _):
        usages: list = []
        seconds = all_at_once(lambda i: conversation(port, i, turns, keyed, usages),
                              conversations)
    later = [(prompt, cached) for turn, prompt, cached in usages if turn > 0]
    first = [(prompt, cached) for turn, prompt, cached in usages if turn == 0]
    return {"keyed": keyed, "turns_answered": len(usages), "seconds": seconds,
            "later_cached": sum(c for _, c in later) / max(1, sum(p for p, _ in later)),
            "first_cached": sum(c for _, c in first) / max(1, sum(p for p, _ in first))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    print("| placed by | turns answered | first turns' prompt tokens cached | later turns' "
          "| seconds |\n|---|---|---|---|---|")
    for keyed in (False, True):
        result = run(args.conversations, args.turns, args.replicas, keyed)
        print(f"| {'prompt_cache_key' if keyed else 'the prompt start'} | "
              f"{result['turns_answered']}/{args.conversations * args.turns} | "
              f"{result['first_cached']:.0%} | {result['later_cached']:.0%} | "
              f"{result['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
