"""Plot a run's `metrics.jsonl`: one panel per key, x = optimizer step (matplotlib, no display needed).

    python -m tools.plot outputs/best_rq/metrics.jsonl -o curve.png [--keys loss,eval_loss]

The format follows the extension of `-o`: .png, .svg or .pdf (anything else is refused). Keys
default to every numeric column except step/epoch/lr/skipped_updates. A quantity that is never
negative (losses, rates) gets an axis that starts at or above 0.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

FORMATS = (".png", ".svg", ".pdf")
NOT_PLOTTED = {"step", "epoch", "lr", "skipped_updates"}


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def plot(rows: list[dict], keys: list[str]):
    """A matplotlib Figure with one panel per key (2 columns when there are several)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display (SSH, SLURM)
    import matplotlib.pyplot as plt

    cols = 2 if len(keys) > 1 else 1
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.0 * cols, 3.0 * nrows), squeeze=False,
                             layout="constrained")  # constrained: titles and labels are never cut
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r[key]) for r in rows
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "step" in r]
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if not pts:
            continue
        steps, values = zip(*pts)
        ax.plot(steps, values, marker="o" if len(pts) < 30 else None, markersize=3)
        if min(values) >= 0:  # the 5 % margin must not invent negative values
            ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot metrics.jsonl (one panel per key).")
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--output", required=True, help=f"the file to write: {', '.join(FORMATS)}")
    parser.add_argument("--keys", default=None, help="comma-separated columns (default: all numeric)")
    args = parser.parse_args(argv)
    suffix = Path(args.output).suffix.lower()
    if suffix not in FORMATS:
        parser.error(f"-o {args.output}: unknown format {suffix or '(no extension)'!r}; use {', '.join(FORMATS)}")
    if not Path(args.metrics).is_file():
        parser.error(f"{args.metrics}: no such file")
    rows = read_metrics(args.metrics)
    if not rows:
        parser.error(f"{args.metrics}: no rows")
    keys = args.keys.split(",") if args.keys else sorted(
        {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)} - NOT_PLOTTED)
    missing = [k for k in keys if not any(k in r for r in rows)]
    if missing:
        parser.error(f"no column {', '.join(missing)} in {args.metrics}")
    fig = plot(rows, keys)
    fig.savefig(args.output, format=suffix[1:], dpi=120)
    print(f"{args.output}: {', '.join(keys)} over {len(rows)} rows")


if __name__ == "__main__":
    main()
