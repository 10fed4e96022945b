"""`specserve bench`'s reports of a run's results: results.md (a table per pair, the K
controller's checks, the concurrency sweep) and the PNG plots."""

from pathlib import Path

from bench import checks, sweep


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def vs_off(r: dict) -> str:
    """ (0.99x of off): a cell of several requests at once against serve_off's at that load."""
    return "" if r["speedup_vs_off"] is None else f" ({r['speedup_vs_off']:.2f}x of off)"


def same_tokens(r: dict) -> str:
    """yes / NO / – of a record's comparison; greedy, with its departures at ties."""
    if r["greedy_matches_target"] is None:
        return fmt(r["sampled_matches_inprocess"])
    ties = r["greedy_departures_at_ties"]
    noted = "" if not ties else " (1 at a tie)" if ties == 1 else f" ({ties} at ties)"
    return fmt(r["greedy_matches_target"]) + noted


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# specserve bench results", "",
             f"`{m['command']}` at commit {m['commit']}, {m['date']}: {m['cpu']}, {m['cores']} "
             f"cores, no GPU, torch {m['torch']} with {m['torch_threads']} thread(s) per process, "
             f"transformers {m['transformers']}, ray {m['ray']}. {m['prompts']} prompts x "
             f"{m['max_tokens']} tokens per cell, modes interleaved prompt by prompt.", ""]
    lines += ["Each pool replica has one torch thread: the drafter and the verifier have a core "
              "each, as two GPUs would; the router and Serve's proxies share what is left "
              "(on a 2-core machine, the same two cores).", ""]
    for name, facts in results["pairs"].items():
        lines += [f"## {name} pair", "", facts["note"] + ".", ""] + pair_lines(facts) + [
            "", "| T | mode | K | q | conc. | tokens/s | speedup | formula | measured/formula "
            "| α | tokens/round | E[N] | mean K | ms/round: draft / verify / transport / router "
            "| overhead p50 ms | exposed p50 ms | bytes/round | same tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["results"]:
            if r["pair"] != name or r["stream"]:
                continue
            split = "–" if r["ms_round"] is None else " / ".join(
                fmt(r[f"ms_{p}"], 1) for p in ("draft", "verify", "transport", "router"))
            lines.append(
                f"| {r['temperature']:g} | {r['mode']} | {r['k']} | {fmt(r['draft_q'])} "
                f"| {r['concurrency']} | {fmt(r['tokens_per_s'], 1)} "
                f"| {fmt(r['speedup'], 2, 'x')}{vs_off(r)} "
                f"| {fmt(r['predicted_speedup'], 2, 'x')} | {fmt(r['speedup_vs_predicted'])} "
                f"| {fmt(r['acceptance_rate'])} | {fmt(r['mean_acceptance_length'])} "
                f"| {fmt(r['predicted_tokens_per_round'])} | {fmt(r['mean_k'])} | {split} "
                f"| {fmt(r['overhead_ms_p50'])} | {fmt(r['exposed_ms_p50'])} "
                f"| {fmt(r['wire_bytes_per_round'], 0)} "
                f"| {same_tokens(r)} |")
        lines.append("")
    lines += ["speedup: tokens/s over `target_only` of the same pair and temperature (one "
              "stream; at conc. > 1 the aggregate's, batching's gain with speculation's, and in "
              "brackets over `serve_off`'s at the same conc., speculation's alone). formula: "
              "E[N] / (t(K+1)/t(1) + K c) with E[N] = (1 - α^(K+1)) / (1 - α) from the measured "
              "α and the target's measured cost curve. q: the draft distribution as shipped "
              "(sampled records). mean K: tokens drafted per round (serve_adaptive: as chosen). "

              "overhead: the median over rounds of the round time less the pools' own compute "
              "(transport and router work; the median of per-request medians). exposed: the "
              "same less only the verifier's compute (what a round waits beyond the verify: "
              "the draft on the critical path, hops, router work). bytes/round: "
              "serialised gRPC messages of the round's two calls. same tokens: greedy, every "
              "request's tokens equal `target_only`'s, or depart from them first with a token "
              "whose logit there is within one unit of the target dtype's rounding of its own "
              "token's (\"at ties\": another batch's rounding breaks a tie either way, bf16's "
              "often); sampled serve_sync, equal to `inprocess`'s with the same seed (the same "
              "draws end to end).", ""]
    if "methods" in results:
        from bench.methods import markdown_lines

        lines += markdown_lines(results["methods"])
    lines += checks.section(results.get("checks", []))
    streamed = [r for r in results["results"] if r["stream"]]
    if streamed:
        lines += sweep.section(streamed, m["sweep"], fmt, same_tokens)
    return "\n".join(lines)


def pair_lines(facts: dict) -> list[str]:
    """The pair's sizes, dtypes, cost curve and c, with a warning where verifying is costly."""
    curve, costs = facts["target_forward_ms"], facts["verify_cost"]
    widest = max(curve, key=int)
    lines = [f"Target {facts['target']['parameters'] / 1e6:.1f}M parameters "
             f"({facts['target']['dtype']}), draft {facts['draft']['parameters'] / 1e6:.2f}M "
             f"({facts['draft']['dtype']}). Target forward over a 64-token cache: "
             + ", ".join(f"{n} token(s) {ms} ms" for n, ms in curve.items())
             + "; t(n)/t(1) = " + ", ".join(str(costs[n]) for n in curve)
             + f". Draft 1 token {facts['draft_forward_ms']} ms; c = {facts['c']}. "
             f"Draft q as shipped: {facts['draft_q']} (exact: the drafter samples from the q "
             "it ships; HF assisted generation uses the full q)."]
    if "dtype_choice" in facts:
        choice = facts["dtype_choice"]
        lines.append("Dtype chosen on this machine: " + choice["chosen"] + " (flattest curve; "
                     + "; ".join(f"{dtype}: " + ", ".join(f"{n} -> {ms} ms" for n, ms in c.items())
                                 for dtype, c in choice["target_forward_ms"].items()) + ").")
    if "balanced_draft" in facts:
        draft = facts["balanced_draft"]
        lines.append(f"Balanced draft: {draft['layers']} layers, c = {draft['c']} when built"
                     + ("" if draft["in_range"] else " (OUTSIDE 0.15-0.25)") + ".")
    if costs[widest] > 1.5:
        lines.append(f"**Verification is far from free on this machine**: {widest} tokens cost "
                     f"{costs[widest]}x one token (compute-bound), so every drafted token also "
                     "costs verifier time and speculation gains less than on a GPU.")
    return lines


def plotted(results: dict) -> list[dict]:
    """The records the K plots draw: one stream, a fixed K, q as the pair's drafter ships it
    (sampled in-process cells also run with dense q where it ships otherwise: those stay in
    the tables), and HF assisted generation."""
    return [r for r in results["results"] if not r["stream"] and (
            r["concurrency"] == 1 and isinstance(r["k"], int)
            and r["draft_q"] in (None, results["pairs"][r["pair"]].get("draft_q"))
            or r["mode"] == "hf_assisted")]


def plot(results: dict, out: Path) -> None:
    """speedup_vs_k.png and acceptance_by_position.png: one panel per pair and temperature;
    concurrency.png (bench/sweep.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streamed = [r for r in results["results"] if r["stream"]]
    if streamed:
        sweep.plot(streamed, out)
    records = plotted(results)
    cells = [(p, t) for p in results["pairs"] for t in results["machine"]["temperatures"]]

    def speedups(ax, rows):
        for mode, style in (("inprocess", "o-"), ("serve_sync", "s-"), ("serve_pipelined", "D-"),
                            ("hf_assisted", "^-")):
            pts = sorted((r["k"], r["speedup"]) for r in rows if r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), style, label=mode)
        pts = sorted((r["k"], r["predicted_speedup"]) for r in rows
                     if r["mode"] == "inprocess" and r["predicted_speedup"])
        if pts:
            ax.plot(*zip(*pts), "k--", label="formula")
        ax.axhline(1.0, color="grey", linewidth=0.8)

    def acceptance(ax, rows):
        rows = [r for r in rows if r["mode"] == "inprocess" and r["acceptance_by_position"]]
        for r in sorted(rows, key=lambda r: r["k"]):
            ax.plot(range(1, len(r["acceptance_by_position"]) + 1), r["acceptance_by_position"],
                    "o-", label=f"K = {r['k']}")
        ax.set_ylim(0, 1)

    for name, draw, xlabel, ylabel in (
            ("speedup_vs_k.png", speedups, "K (drafted tokens per round)",
             "speedup over target alone"),
            ("acceptance_by_position.png", acceptance, "draft position",
             "fraction of rounds accepted")):
        fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.6), squeeze=False)
        for ax, (pair, temperature) in zip(axes[0], cells):
            draw(ax, [r for r in records if r["pair"] == pair and r["temperature"] == temperature])
            ax.set_title(f"{pair} pair, T = {temperature:g}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

