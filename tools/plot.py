"""Plot a run's `metrics.jsonl`, x = optimizer step (matplotlib, no display needed).

    python -m tools.plot outputs/best_rq/metrics.jsonl -o curve.png [--keys loss,eval_loss] [--separate]

The format follows the extension of `-o`: .png, .svg or .pdf (anything else is refused). Keys
default to every numeric column except step/epoch/lr/skipped_updates.

Panels: a metric and its validation twin (`loss` and `eval_loss`, `ctc_loss` and `eval_ctc_loss`)
share one panel titled by the metric, with a legend, so training and validation are read against
one y axis; every other key has its own panel. `--separate` gives every key its own panel.

Axes say what the numbers are, never how they were zoomed:
- no offset notation: tick labels are the values themselves (matplotlib would otherwise write
  0.9874..0.9893 as 0.0001..0.0020 under a "+0.987" that is easy to miss);
- a y axis spans at least 10 % of the largest |value| drawn in its panel (MIN_SPAN). A change
  smaller than that (a WER moving from 0.9893 to 0.9874, 0.2 %) stays a near-flat line instead of
  filling the panel as a cliff; changes larger than that keep matplotlib's own limits;
- a quantity that is never negative (losses, rates) gets an axis that starts at or above 0.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

FORMATS = (".png", ".svg", ".pdf")
NOT_PLOTTED = {"step", "epoch", "lr", "skipped_updates"}
EVAL = "eval_"  # the prefix the loop gives validation metrics (`loss` -> `eval_loss`)
MIN_SPAN = 0.10  # a y axis spans at least this fraction of the largest |value| in its panel


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def panels(keys: list[str], separate: bool = False) -> list[list[str]]:
    """Keys grouped into panels, in the order given: `X` and `eval_X` together when both are asked for."""
    if separate:
        return [[k] for k in keys]
    grouped, placed = [], set()
    for key in keys:
        if key in placed:
            continue
        base = key[len(EVAL):] if key.startswith(EVAL) else key
        group = [k for k in (base, EVAL + base) if k in keys] if base in keys and EVAL + base in keys else [key]
        grouped.append(group)
        placed.update(group)
    return grouped


def _y_limits(lo: float, hi: float, values: list[float]) -> tuple[float, float]:
    """matplotlib's limits (lo, hi) widened to MIN_SPAN of the largest |value|, not below 0 for data that never is."""
    need = MIN_SPAN * max(abs(v) for v in values)
    if hi - lo < need:  # a zoom that would blow a small change up: centre the data in the minimum span
        mid = (min(values) + max(values)) / 2
        lo, hi = mid - need / 2, mid + need / 2
    if min(values) >= 0 and lo < 0:  # the margin must not invent negative values; keep the span
        lo, hi = 0.0, max(hi, need)
    return lo, hi


def default_keys(rows: list[dict]) -> list[str]:
    """Every numeric column but NOT_PLOTTED, by name, each eval_X right after its X."""
    return sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                  - NOT_PLOTTED, key=lambda k: (k.removeprefix(EVAL), k.startswith(EVAL)))


def plot(rows: list[dict], keys: list[str], separate: bool = False):
    """A matplotlib Figure, one panel per group of `panels(keys)` (2 columns when there are several)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display (SSH, SLURM)
    import matplotlib.pyplot as plt

    groups = panels(keys, separate)
    cols = 2 if len(groups) > 1 else 1
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.0 * cols, 3.0 * nrows), squeeze=False,
                             layout="constrained")  # constrained: titles and labels are never cut
    for ax, group in zip(axes.flat, groups):
        ax.set_title(group[0])
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        drawn = []
        for key in group:
            pts = [(r["step"], r[key]) for r in rows
                   if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and "step" in r]
            if not pts:
                continue
            steps, values = zip(*pts)
            ax.plot(steps, values, marker="o" if len(pts) < 30 else None, markersize=3, label=key)
            drawn += values
        ax.ticklabel_format(axis="both", useOffset=False)  # tick labels are the values, no "+1.868"
        if not drawn:
            continue
        if len(group) > 1:
            ax.legend()
        ax.set_ylim(*_y_limits(*ax.get_ylim(), drawn))
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot metrics.jsonl (a metric and its eval_ twin share a panel).")
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--output", required=True, help=f"the file to write: {', '.join(FORMATS)}")
    parser.add_argument("--keys", default=None, help="comma-separated columns (default: all numeric)")
    parser.add_argument("--separate", action="store_true", help="one panel per key (default: X and eval_X share one)")
    args = parser.parse_args(argv)
    suffix = Path(args.output).suffix.lower()
    if suffix not in FORMATS:
        parser.error(f"-o {args.output}: unknown format {suffix or '(no extension)'!r}; use {', '.join(FORMATS)}")
    if not Path(args.metrics).is_file():
        parser.error(f"{args.metrics}: no such file")
    rows = read_metrics(args.metrics)
    if not rows:
        parser.error(f"{args.metrics}: no rows")
    keys = args.keys.split(",") if args.keys else default_keys(rows)
    missing = [k for k in keys if not any(k in r for r in rows)]
    if missing:
        parser.error(f"no column {', '.join(missing)} in {args.metrics}")
    fig = plot(rows, keys, args.separate)
    fig.savefig(args.output, format=suffix[1:], dpi=120)
    print(f"{args.output}: {' | '.join(', '.join(g) for g in panels(keys, args.separate))} over {len(rows)} rows")


if __name__ == "__main__":
    main()
