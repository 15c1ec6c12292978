"""Run report: PNG plots and report.html from a run directory's metrics.jsonl (and optional extras).

    python -m tlt.report runs/tlt/default    # or called by `tlt train` at the end of a run

Inputs in the run directory: metrics.jsonl (one JSON object per step, verl-style keys), optionally
response_lengths.jsonl ({"step", "lengths": [...]} per step) for length distributions, and sd_compare.json
({"with_sd_s", "without_sd_s", "pair_speedups", ...}: the same rollout timed with speculation on and off, interleaved).
Outputs: one PNG per plot, overview.png (all plots in one picture) and report.html.
"""
from __future__ import annotations

import html
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _line_plot(rows, keys: list[tuple[str, str]], title: str, ylabel: str, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    drawn = False
    for key, label in keys:
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, marker="o", ms=3, label=label)
            drawn = True
    if drawn:
        ax.set(title=title, xlabel="RL step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _length_plot(rows, lengths: list[dict], path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if lengths:
        ax.boxplot([r["lengths"] for r in lengths], positions=[r["step"] for r in lengths], widths=0.6,
                   showfliers=True, flierprops={"markersize": 2})
        ax.set(title="Response length per step (box: p25-p75, whiskers 1.5 IQR)")
    else:
        for key, label in (("response_length/p50", "p50"), ("response_length/p90", "p90"),
                           ("response_length/max", "max")):
            x, y = _series(rows, key)
            ax.plot(x, y, marker="o", ms=3, label=label)
        ax.legend(fontsize=8)
        ax.set(title="Response length per step")
    ax.set(xlabel="RL step", ylabel="tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bool(lengths or rows)


def _phase_plot(rows, path: Path) -> bool:
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    if not phases:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.4))
    bottom = [0.0] * len(rows)
    steps = [r["step"] for r in rows]
    for ph in phases:
        vals = [r.get(ph) or 0.0 for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=ph.split("/", 1)[1])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(title="Time per phase", xlabel="RL step", ylabel="seconds")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _sd_compare_plot(cmp: dict, path: Path) -> bool:
    if not cmp:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.0))
    plain, sd = cmp["without_sd_s"], cmp["with_sd_s"]
    ax.bar(["without SD", "with adaptive SD"], [sum(plain) / len(plain), sum(sd) / len(sd)],
           color=["#999999", "#2a7ab9"])
    for x, ys in ((0, plain), (1, sd)):  # each timed pass: the spread is the machine's noise
        ax.scatter([x] * len(ys), ys, color="black", s=12, zorder=3)
    pairs = ", ".join(f"{r:.2f}" for r in cmp["pair_speedups"])
    ax.set(title=f"Same rollout, SD off vs on: {cmp['speedup']:.2f}x (pairs {pairs})", ylabel="seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _overview(pngs: list[Path], path: Path, cols: int = 2, width: int = 480) -> None:
    """All plots in one picture (two columns), for a README or a quick look."""
    from PIL import Image
    if not pngs:
        return
    tiles = []
    for p in pngs:
        with Image.open(p) as im:
            tiles.append(im.convert("RGB").resize((width, round(im.height * width / im.width))))
    h = max(t.height for t in tiles)
    rows = (len(tiles) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * width, rows * h), "white")
    for i, t in enumerate(tiles):
        sheet.paste(t, ((i % cols) * width, (i // cols) * h))
    sheet.save(path)


def make_report(run_dir: str | Path, summary: dict | None = None) -> Path:
    run = Path(run_dir)
    rows = _read_jsonl(run / "metrics.jsonl")
    lengths = _read_jsonl(run / "response_lengths.jsonl")
    cmp_path = run / "sd_compare.json"
    cmp = json.loads(cmp_path.read_text()) if cmp_path.is_file() else {}
    plots = [
        ("reward.png", "Reward and accuracy", _line_plot(rows, [("critic/score/mean", "train reward (mean)"),
                                                                ("val/accuracy", "held-out accuracy")],
                                                         "Reward / accuracy", "score", run / "reward.png")),
        ("lengths.png", "Response lengths", _length_plot(rows, lengths, run / "lengths.png")),
        ("accept.png", "Speculative accept length",
         _line_plot(rows, [("rollout/spec_accept_length", "accept length (tokens / verify step)")],
                    "Accept length per step", "tokens", run / "accept.png")),
        ("drafters.png", "Drafters on each step's fresh held-out responses, before training on them: online (the one "
         "in use) vs the frozen warm-start vs n-gram (accept-length proxy, teacher-forced greedy; tlt.drafter_train."
         "compare), and the accept length measured in the rollout",
         _line_plot(rows, [("drafter/compare/online", "online drafter (proxy)"),
                           ("drafter/compare/frozen", "frozen warm-start drafter (proxy)"),
                           ("drafter/compare/ngram", "n-gram drafter (proxy)"),
                           ("rollout/spec_accept_length", "measured in rollout (adaptive arms)")],
                    "Accept length: online vs frozen vs n-gram", "tokens / verify step", run / "drafters.png")),
        ("spot.png", "Spot training (Ray rollout workers): idle replica time, the part harvested for drafter "
         "training, and how long training delayed the step after the last rollout finished",
         _line_plot(rows, [("spot/idle_s_total", "idle replica-seconds"),
                           ("spot/harvested_s_total", "harvested for drafter training (s)"),
                           ("spot/barrier_delay_s", "delay of the next phase (s)")],
                    "Idle time harvested per step", "seconds", run / "spot.png")),
        ("sd_on.png", "SD-on fraction", _line_plot(rows, [("rollout/spec_on_fraction", "SD-on fraction of decode steps")],
                                                   "SD-on fraction", "fraction", run / "sd_on.png")),
        ("phases.png", "Time per phase", _phase_plot(rows, run / "phases.png")),
        ("sd_compare.png", "Rollout with vs without SD", _sd_compare_plot(cmp, run / "sd_compare.png")),
    ]
    _overview([run / f for f, _, ok in plots if ok], run / "overview.png")
    parts = ["<html><head><meta charset='utf-8'><title>tlt run report</title>",
             "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}img{max-width:48%;margin:4px}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px}</style></head><body>",
             f"<h1>tlt run report</h1><p>{html.escape(str(run.resolve()))}</p>"]
    if summary:
        parts.append("<h2>Summary</h2><table>" + "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
            + "</table>")
    length_rows = [r for r in rows if r.get("response_length/p50") is not None]
    if length_rows:
        cols = ("response_length/p50", "response_length/p90", "response_length/max")
        parts.append("<h2>Response lengths per step</h2><table><tr><th>step</th><th>p50</th><th>p90</th><th>max</th>"
                     "<th>max / p50</th></tr>" + "".join(
                         f"<tr><td>{r['step']}</td>" + "".join(f"<td>{r[c]:.0f}</td>" for c in cols)
                         + f"<td>{r['response_length/max'] / max(r['response_length/p50'], 1):.1f}</td></tr>"
                         for r in length_rows) + "</table>")
    parts.append("<h2>Plots</h2>")
    parts += [f"<figure style='display:inline-block;width:48%'><img style='max-width:100%' src='{f}'>"
              f"<figcaption>{t}</figcaption></figure>" for f, t, ok in plots if ok]
    parts.append("</body></html>")
    out = run / "report.html"
    out.write_text("\n".join(parts))
    return out


if __name__ == "__main__":
    print(make_report(sys.argv[1]))
