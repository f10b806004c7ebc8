"""A full disk during a save or an export, said in one line: what filled up, what was kept, how much to
free and which files may go (`disk_full_message`); `is_disk_full` recognizes it behind the writers'
own exceptions.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path

from common.training.sealing import list_checkpoints

def is_disk_full(e: BaseException) -> bool:
    """A full disk or quota, also when the writer wraps the OS error in its own exception (torch's
    zip writer: a RuntimeError "unexpected pos"; safetensors: a SafetensorError "... (os error 28)")."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left", "os error 28", "Disk quota exceeded", "unexpected pos")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _mount_point(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def weight_bytes(models) -> int:
    return sum(p.numel() * p.element_size() for m in models for p in m.parameters())


def checkpoint_bytes(output_dir: str | Path, models, master_copy: bool = False) -> int:
    """The size of a checkpoint: the newest one's, else weights + two AdamW moments (+ DeepSpeed's
    fp32 master copy of the weights, in its optimizer files)."""
    previous = list_checkpoints(output_dir)
    if previous:  # FSDP shards, DeepSpeed's pytorch_model/: subfolders
        return sum(f.stat().st_size for f in previous[-1].rglob("*") if f.is_file())
    return (3 + master_copy) * weight_bytes(models)


def disk_full_message(output_dir: str | Path, doing: str, need: int, removed: str, then: str) -> str:
    """One line: what filled up, what was kept, how much to free and which files may go.

    Pruning (--save_total_limit) deletes older checkpoints only after a newer one is complete, so
    on a full disk the space must be freed by hand before the re-run."""
    mb = lambda n: f"{n / 1e6:.1f}" if n < 1e7 else f"{n / 1e6:.0f}"  # noqa: E731 — small runs too
    mount = _mount_point(Path(output_dir))
    free = shutil.disk_usage(output_dir).free
    ckpts = list_checkpoints(output_dir)
    kept = f"step {int(ckpts[-1].name[5:])} is kept" if ckpts else "no earlier checkpoint exists"
    older = ckpts[:-1]  # the newest is the one to resume from
    hint = ""
    if older:
        names = ", ".join(p.name for p in older[:3]) + (f" and {len(older) - 3} more" if len(older) > 3 else "")
        size = sum(f.stat().st_size for c in older for f in c.rglob("*") if f.is_file())
        hint = f" (e.g. the older checkpoints in {ckpts[-1].parent}: {names}, {mb(size)} MB; keep {ckpts[-1].name})"
    amount = f"at least {math.ceil((need - free) / 1e5) / 10:g} MB" if need > free else "some space"  # rounded up
    return (f"no space left on {mount} while {doing} (needs ~{mb(need)} MB, {mb(free)} MB free); {removed} and "
            f"{kept}. Free {amount} on {mount}{hint}, then re-run the same command to {then} "
            f"(--save_total_limit deletes older checkpoints only after a newer one is saved)")
