"""Checkpoint cost: `common.training.checkpoint.save_checkpoint` against `torch.save` + fsync of the same state.

    python benchmarks/checkpoint.py [--recipe best_rq] [--repeats 7]

Builds the recipe's default model (its config.yaml) and AdamW with its moments filled (one step),
then alternates, `--repeats` times: our save (accelerate `save_state`, train_state.json, fsync and
SHA-256 of every file, COMPLETE marker, atomic rename, pruning to `save_total_limit` 2) and the
baseline (`torch.save({model, optimizer})` into one file + fsync). Prints medians, the ratio, and a
breakdown of our save measured the same way. One process, the machine's threads.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--root" in sys.argv:  # another checkout's common/ (e.g. a worktree of an older commit): before/after
    sys.path.insert(0, sys.argv[sys.argv.index("--root") + 1])
sys.path.insert(1 if "--root" in sys.argv else 0, str(ROOT))


def build(recipe: str, root: str | None = None):
    """(accelerator, prepared model, optimizer, scheduler, state) for the recipe's default config."""
    import torch

    from benchmarks.recipe import load_recipe
    from common.training.distributed import build_accelerator
    from common.training.loop import lr_schedule

    if root:  # that checkout's recipe too (its Config and model, as it was)
        import benchmarks.recipe

        benchmarks.recipe.ROOT = Path(root)
    r = load_recipe(recipe)  # its models take its data (build_models(cfg, data))
    try:
        from common.training.state import TrainState
    except ImportError:  # a checkout from before common/training/checkpoint.py was split
        from common.training.checkpoint import TrainState
    try:
        from common.training.distributed import set_threads
    except ImportError:  # an older checkout: torch's default, which is also one thread per core
        set_threads = lambda n: None  # noqa: E731
    set_threads(0)
    accelerator = getattr(r, "accelerator", None) or build_accelerator()
    model = r.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(10))
    model, optimizer = accelerator.prepare(model, optimizer)
    for p in model.parameters():  # fill the AdamW moments, as in a running job
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = TrainState.for_run(r.cfg, 1, 1)
    return accelerator, model, optimizer, scheduler, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="best_rq", choices=["best_rq", "asr", "tts"])
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repetitions of each measurement")
    ap.add_argument("--root", help="measure the save_checkpoint of this checkout instead (its common/); "
                                   "the breakdown is skipped")
    args = ap.parse_args()

    import torch

    import common.training.checkpoint
    from common.training.checkpoint import save_checkpoint

    pieces = args.root is None
    if pieces:
        from common.training.sealing import file_digest, seal_files

    accelerator, model, optimizer, scheduler, state = build(args.recipe, args.root)
    if "models" in inspect.signature(save_checkpoint).parameters:
        state.stage = "boundary"  # as end_step leaves it
        save = lambda state: save_checkpoint(accelerator, work / "run", state, models=model,  # noqa: E731
                                             optimizers=optimizer, schedulers=scheduler, save_total_limit=2)
    else:  # a --root checkout from before several models
        save = lambda state: save_checkpoint(accelerator, model, work / "run", state, scheduler,  # noqa: E731
                                             save_total_limit=2)
    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.environ.get("BENCH_DIR")))
    ours, base = [], []
    parts = {k: [] for k in ("save_state", "fsync + digest (parallel)", "digest alone (serial)",
                             "finite check", "prune one checkpoint")}
    try:
        for rep in range(args.repeats):
            state.step = rep + 1
            t = time.perf_counter()
            ckpt = save(state)
            ours.append(time.perf_counter() - t)

            t = time.perf_counter()
            path = work / "baseline.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            base.append(time.perf_counter() - t)

            if not pieces:
                continue
            # the pieces, one by one
            folder = work / "pieces"
            shutil.rmtree(folder, ignore_errors=True)
            t = time.perf_counter()
            accelerator.save_state(str(folder))
            parts["save_state"].append(time.perf_counter() - t)
            t = time.perf_counter()
            seal_files(folder)
            parts["fsync + digest (parallel)"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for p in folder.iterdir():
                file_digest(p)
            parts["digest alone (serial)"].append(time.perf_counter() - t)
            t = time.perf_counter()
            params = [p.detach() for p in model.parameters()]
            bool(torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf")))).all())
            parts["finite check"].append(time.perf_counter() - t)
            t = time.perf_counter()
            shutil.rmtree(folder)
            parts["prune one checkpoint"].append(time.perf_counter() - t)
        size = sum(p.stat().st_size for p in ckpt.iterdir()) / 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)

    m_ours, m_base = statistics.median(ours), statistics.median(base)
    print(f"checkpoint benchmark, recipe {args.recipe}, common/ of {Path(common.training.checkpoint.__file__).parents[1]}: "
          f"{size:.1f} MB per checkpoint, "
          f"{args.repeats} interleaved repetitions, medians, {torch.get_num_threads()} thread(s)")
    print(f"  save_checkpoint / (torch.save + fsync) = {m_ours / m_base:.2f}   "
          f"({m_ours * 1e3:.0f} ms vs {m_base * 1e3:.0f} ms)")
    for name, ts in parts.items() if pieces else ():
        print(f"  {name:28s} {statistics.median(ts) * 1e3:6.0f} ms  = {statistics.median(ts) / m_base:.2f} × baseline")


if __name__ == "__main__":
    main()
