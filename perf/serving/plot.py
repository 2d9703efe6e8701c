"""The InferenceX picture: throughput per GPU (y) against interactivity, tok/s per user (x).

One curve per label, points in concurrency order and annotated with it. x is
`interactivity_tok_s_per_user` at the chosen percentile (1000 / TPOT there); y is output (or
total) tokens/s per GPU. A second panel shows cost per 1M output tokens against the same x.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from perf.serving.metrics import pkey


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def points(docs: Sequence[dict], y_metric: str, x_percentile: float) -> dict[str, list[tuple[int, float, float, float | None]]]:
    """label → [(concurrency, x, y, cost)] sorted by concurrency; runs without an x are skipped."""
    ykey = "output_throughput_per_gpu" if y_metric == "output" else "total_token_throughput_per_gpu"
    out: dict[str, list] = {}
    for d in docs:
        x = (d.get("interactivity_tok_s_per_user") or {}).get(pkey(x_percentile))
        if x is None:
            continue
        out.setdefault(str(d.get("label")), []).append(
            (int(d.get("max_concurrency") or 0), float(x), float(d[ykey]), d.get("cost_per_million_output_tokens_usd")))
    return {k: sorted(v) for k, v in out.items()}


def draw(docs: Sequence[dict], out: str | Path, y_metric: str = "output", x_percentile: float = 50.0) -> Path:
    """Write the PNG and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_cost) = plt.subplots(1, 2, figsize=(13, 5.5))
    for label, pts in points(docs, y_metric, x_percentile).items():
        xs, ys = [p[1] for p in pts], [p[2] for p in pts]
        ax.plot(xs, ys, marker="o", label=label)
        for c, x, y, _ in pts:
            ax.annotate(f"c{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        cost = [(p[1], p[3]) for p in pts if p[3] is not None]
        if cost:
            ax_cost.plot([a for a, _ in cost], [b for _, b in cost], marker="o", label=label)
    ax.set_xlabel(f"interactivity, tok/s/user (p{x_percentile:g}: 1000 / TPOT)")
    ax.set_ylabel(f"{y_metric} tok/s per GPU")
    ax.set_title("throughput vs interactivity")
    ax_cost.set_xlabel(ax.get_xlabel())
    ax_cost.set_ylabel("USD per 1M output tokens")
    ax_cost.set_title("cost vs interactivity")
    for a in (ax, ax_cost):
        a.grid(True, alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
