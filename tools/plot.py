"""Plot a run's `metrics.jsonl` as an SVG (no plotting library needed; GitHub renders SVG in READMEs).

    python -m tools.plot outputs/best_rq/metrics.jsonl -o curve.svg [--keys loss,eval_loss]

One panel per key, x = optimizer step. Keys default to every numeric column except step/epoch/lr.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

W, H, PAD = 420, 180, 42  # one panel, pixels
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def _nice(lo: float, hi: float) -> tuple[float, float]:
    if hi - lo < 1e-12:
        return lo - 0.5, hi + 0.5
    margin = 0.05 * (hi - lo)
    return lo - margin, hi + margin


def panel(rows: list[dict], key: str, x0: int, y0: int, color: str) -> list[str]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    out = [f'<rect x="{x0 + PAD}" y="{y0 + 10}" width="{W - PAD - 10}" height="{H - PAD - 10}" '
           f'fill="none" stroke="#999"/>',
           f'<text x="{x0 + W / 2}" y="{y0 + 8}" font-size="12" text-anchor="middle">{key}</text>']
    if not pts:
        return out
    (sx0, sx1), (sy0, sy1) = _nice(min(p[0] for p in pts), max(p[0] for p in pts)), \
        _nice(min(p[1] for p in pts), max(p[1] for p in pts))

    def xy(s, v):
        return (x0 + PAD + (s - sx0) / (sx1 - sx0) * (W - PAD - 10),
                y0 + 10 + (1 - (v - sy0) / (sy1 - sy0)) * (H - PAD - 10))

    path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(xy(s, v) for s, v in pts))
    out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    if len(pts) < 30:
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in (xy(s, v) for s, v in pts)]
    for v in (sy0, (sy0 + sy1) / 2, sy1):
        _, y = xy(sx0, v)
        out.append(f'<text x="{x0 + PAD - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{v:.3g}</text>')
    for s in (pts[0][0], pts[-1][0]):
        x, _ = xy(s, sy0)
        out.append(f'<text x="{x:.1f}" y="{y0 + H - PAD + 14}" font-size="10" text-anchor="middle">{s}</text>')
    out.append(f'<text x="{x0 + W / 2}" y="{y0 + H - 8}" font-size="10" text-anchor="middle">optimizer step</text>')
    return out


def plot(rows: list[dict], keys: list[str]) -> str:
    cols = 2 if len(keys) > 1 else 1
    nrows = math.ceil(len(keys) / cols)
    body = []
    for i, key in enumerate(keys):
        body += panel(rows, key, (i % cols) * W, (i // cols) * H, COLORS[i % len(COLORS)])
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * W}" height="{nrows * H}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>' + "".join(body) + "</svg>\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot metrics.jsonl as an SVG.")
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--output", required=True, help="the .svg to write")
    parser.add_argument("--keys", default=None, help="comma-separated columns (default: all numeric)")
    args = parser.parse_args(argv)
    rows = read_metrics(args.metrics)
    if not rows:
        parser.error(f"{args.metrics}: no rows")
    keys = args.keys.split(",") if args.keys else sorted(
        {k for r in rows for k, v in r.items() if isinstance(v, (int, float))} - {"step", "epoch", "lr", "skipped_updates"})
    missing = [k for k in keys if not any(k in r for r in rows)]
    if missing:
        parser.error(f"no column {', '.join(missing)} in {args.metrics}")
    Path(args.output).write_text(plot(rows, keys))
    print(f"{args.output}: {', '.join(keys)} over {len(rows)} rows")


if __name__ == "__main__":
    main()
