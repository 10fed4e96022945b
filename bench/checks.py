"""What `specserve bench` checks of the default K controller, from the records of its own run.

Per pair and temperature, one request at a time: `serve_adaptive` (the router's default,
num_speculative_tokens "auto"; sampled, without a seed) against the best fixed K served
(`serve_sync` or `serve_pipelined`) and against speculation off (`serve_off`). Ratios from
one run, so a slower or faster machine moves both sides; the goals hold at T = 0, T = 1 is
reported.
"""

GOAL_VS_BEST_FIXED = 0.9
GOAL_VS_OFF = 1.3
FIXED = ("serve_sync", "serve_pipelined")


def adaptive_checks(records: list[dict]) -> list[dict]:
    """One check per (pair, temperature) whose run has the three kinds of record."""
    single = [r for r in records if not r["stream"] and r["concurrency"] == 1]
    checks = []
    for pair, temperature in sorted({(r["pair"], r["temperature"]) for r in single}):
        cell = [r for r in single if (r["pair"], r["temperature"]) == (pair, temperature)]
        adaptive = [r for r in cell if r["mode"] == "serve_adaptive"]
        off = [r for r in cell if r["mode"] == "serve_off"]
        fixed = [r for r in cell if r["mode"] in FIXED and r["k"] != 0]
        if not (adaptive and off and fixed):
            continue
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        rate = adaptive[0]["tokens_per_s"]
        vs_best, vs_off = rate / best["tokens_per_s"], rate / off[0]["tokens_per_s"]
        check = {"pair": pair, "temperature": temperature, "adaptive_tokens_per_s": rate,
                 "adaptive_mean_k": adaptive[0]["mean_k"],
                 "best_fixed": f"{best['mode']} K={best['k']}",
                 "best_fixed_tokens_per_s": best["tokens_per_s"],
                 "off_tokens_per_s": off[0]["tokens_per_s"],
                 "vs_best_fixed": round(vs_best, 3), "vs_off": round(vs_off, 3)}
        # judged on the ratios themselves: a miss is not rounded up to the goal
        check["meets_goals"] = (vs_best >= GOAL_VS_BEST_FIXED and vs_off >= GOAL_VS_OFF) \
            if temperature == 0 else None
        checks.append(check)
    return checks


def section(checks: list[dict]) -> list[str]:
    """The checks as a markdown section."""
    lines = ["## The default K controller", "",
             f"`serve_adaptive` (the default request) against the best fixed K served and "
             f"against speculation off, one request at a time (T = 1 unseeded: a seeded "
             f"request runs a fixed K). Goals at T = 0: at least "
             f"{GOAL_VS_BEST_FIXED}x the best fixed K and {GOAL_VS_OFF}x off; T = 1 reported.",
             "", "| pair | T | adaptive tokens/s (mean K) | best fixed | off tokens/s "
             "| vs best fixed | vs off | goals |", "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        verdict = {True: "met", False: "MISSED", None: "–"}[c["meets_goals"]]
        lines.append(f"| {c['pair']} | {c['temperature']:g} | {c['adaptive_tokens_per_s']:.1f} "
                     f"({c['adaptive_mean_k']:.2f}) | {c['best_fixed']}: "
                     f"{c['best_fixed_tokens_per_s']:.1f} | {c['off_tokens_per_s']:.1f} "
                     f"| {c['vs_best_fixed']:.2f}x | {c['vs_off']:.2f}x | {verdict} |")
    return lines + [""]
