"""`splitserve bench plot`: PNGs from `splitserve bench serve` result files (matplotlib, Agg).

- cdf_ttft.png, cdf_itl.png, cdf_e2e.png: the empirical CDF of each latency over the run's
  successful requests, one line per run (per class for runs with several, e.g. mixed),
  named by the run's label.
- vs_concurrency.png: TTFT and ITL p50 (solid) and p99 (dashed) against the run's
  --concurrency, one line per label group. A group is the label up to its last '-'
  (agg-c1, agg-c8 -> agg; disagg-c8 -> disagg). Open-loop runs (no concurrency) are left out.

matplotlib is imported on first use, so the command line stays quick to start.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np

CDF_METRICS = {"ttft": "TTFT", "itl": "ITL", "e2e": "E2E latency"}


def add_arguments(p) -> None:
    p.add_argument("results", nargs="+", help="result JSON files of `splitserve bench serve`")
    p.add_argument("--out", default="docs/img", help="folder for the PNGs")


def run(args) -> list[str]:
    return plot_results(args.results, args.out)


def plot_results(paths: list[str], out: str) -> list[str]:
    """Write every plot the results allow into `out`; the written paths."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    os.makedirs(out, exist_ok=True)
    written = [plot_cdf(results, m, os.path.join(out, f"cdf_{m}.png")) for m in CDF_METRICS]
    written.append(plot_vs_concurrency(results, os.path.join(out, "vs_concurrency.png")))
    return [p for p in written if p is not None]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _samples_ms(result: dict, metric: str) -> dict[str, np.ndarray]:
    """Line name -> the metric's values in ms over successful requests (ITL gaps pooled)."""
    ok = [r for r in result["requests"] if r["error"] is None]
    classes = sorted({r["cls"] for r in ok})
    groups = ({result["label"]: ok} if len(classes) < 2 else
              {f"{result['label']} [{c}]": [r for r in ok if r["cls"] == c] for c in classes})
    out = {}
    for name, records in groups.items():
        if metric == "itl":
            values = [gap for r in records for gap in r["itl"]]
        else:
            values = [r[metric] for r in records if r[metric] is not None]
        if values:
            out[name] = np.sort(np.asarray(values)) * 1000.0
    return out


def plot_cdf(results: list[dict], metric: str, path: str) -> str | None:
    lines = {name: v for r in results for name, v in _samples_ms(r, metric).items()}
    if not lines:
        return None    # e.g. TTFT and ITL of non-streaming runs
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in lines.items():
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=name)
    ax.set(xlabel=f"{CDF_METRICS[metric]} (ms)", ylabel="fraction of requests" if metric != "itl"
           else "fraction of token gaps", title=f"{CDF_METRICS[metric]} CDF", ylim=(0, 1.01))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def group_name(label: str) -> str:
    return label.rsplit("-", 1)[0] if "-" in label else label


def plot_vs_concurrency(results: list[dict], path: str) -> str | None:
    groups: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for r in results:
        if r["load"].get("concurrency") is not None:
            groups[group_name(r["label"])].append((r["load"]["concurrency"], r["metrics"]))
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric in zip(axes, ("ttft", "itl")):
        for i, (group, runs) in enumerate(sorted(groups.items())):
            runs.sort(key=lambda run: run[0])
            x = [c for c, _ in runs]
            for q, style in (("p50", "-"), ("p99", "--")):
                y = [m[f"{metric}_ms"][q] for _, m in runs]
                y = [np.nan if v is None else v for v in y]
                ax.plot(x, y, style, marker="o", color=f"C{i}", label=f"{group} {q}")
        ax.set(xlabel="concurrency", ylabel=f"{metric.upper()} (ms)",
               title=f"{metric.upper()} vs concurrency")
        ax.set_xscale("log", base=2)
        ticks = sorted({c for runs in groups.values() for c, _ in runs})
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
