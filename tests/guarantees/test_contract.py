"""Every training script goes through the loop helpers (common/training/loop.py, checkpoint.py, resume.py) in the
order their contracts need, and steps, saves and loads nothing behind their backs. A static check of
the source (AST): the helpers check their own order at run time too, but only on the paths a run takes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(ROOT.glob("recipes/*/train.py")) + [ROOT / "tests/harness/support/gan_recipe/train.py"]

# The start-of-run sequence, in source order: where to resume → the global batch it fixes → the
# sampler sized to it → prepare → load the checkpoint → the loop.
SEQUENCE = ("choose_checkpoint", "global_batch_plan", "make_loader", "prepare", "resume_from_checkpoint",
            "train_batches")
# Calls that make the sequence's calls for the recipe (common/training/run.py, common/data/loading.py, the recipe's own
# build_data seam), in this order: they stand for them at the line they are called.
ALIASES = {"start_run": ("choose_checkpoint", "global_batch_plan"),
           "build_data": ("make_loader",), "build_loaders": ("make_loader",)}
IN_LOOP = ("no_sync_unless", "optimizer_update", "end_step", "save_or_preempt")  # inside the train_batches loop
FORBIDDEN = {"step": "optimizer.step()/scheduler.step(): use optimizer_update and end_step",
             "save_state": "accelerator.save_state: use save_or_preempt (save_checkpoint)",
             "load_state": "accelerator.load_state: use resume_from_checkpoint",
             "clip_grad_norm_": "clipping: optimizer_update does it (with the non-finite skip)",
             "skip_first_batches": "train_batches resumes mid-epoch"}


def called(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def problems(source: str) -> list[str]:
    """What `source` (a train.py) does against the loop contract; empty when it keeps it."""
    tree = ast.parse(source)
    calls = [(called(n), n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    found = []
    first = {}
    for name, node in calls:
        if name in FORBIDDEN and isinstance(node.func, ast.Attribute):
            found.append(f"line {node.lineno}: .{name}() — {FORBIDDEN[name]}")
        for alias in (name, *ALIASES.get(name, ())):
            if alias is not None and (alias not in first or node.lineno < first[alias]):
                first[alias] = node.lineno
    missing = [n for n in (*SEQUENCE, *IN_LOOP, "export_final") if n not in first]
    found += [f"never calls {n}" for n in missing]
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.iter, ast.Call)
             and called(n.iter) == "train_batches"]
    # The order is the one of the function that runs the loop (`main`): the seams defined above it
    # (build_data, ...) are called from it, where their aliases stand for what they do.
    mains = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(
        loop in ast.walk(f) for loop in loops)]
    in_main = {}
    for node in (n for f in mains[-1:] for n in ast.walk(f) if isinstance(n, ast.Call)):
        for alias in (called(node), *ALIASES.get(called(node), ())):
            if alias is not None and (alias not in in_main or node.lineno < in_main[alias]):
                in_main[alias] = node.lineno
    order = [n for n in SEQUENCE if n in in_main]
    if order != sorted(order, key=in_main.get):
        found.append(f"start-of-run calls out of order: {sorted(order, key=in_main.get)} (needed: {order})")
    inside = {called(n) for loop in loops for n in ast.walk(loop) if isinstance(n, ast.Call)}
    found += [f"{n} is not inside the `for ... in train_batches(...)` loop" for n in IN_LOOP
              if n in first and n not in inside]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_keeps_the_loop_contract(script):
    assert problems(script.read_text()) == []


def test_the_check_finds_a_bypass():
    """A recipe that steps its schedule itself, saves with accelerate, or resumes after its loop
    started is caught (the check can fail)."""
    source = (ROOT / "recipes/best_rq/train.py").read_text()
    assert "end_step(state, scheduler)" in source
    stepped = source.replace("end_step(state, scheduler)", "scheduler.step()")
    assert "never calls end_step" in problems(stepped)
    assert any(p.endswith(f".step() — {FORBIDDEN['step']}") for p in problems(stepped))
    saved = source.replace("save_or_preempt(", "accelerator.save_state(")
    assert any("save_state" in p for p in problems(saved)) and "never calls save_or_preempt" in problems(saved)
    lines = source.splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if "= start_run(cfg" in line)
    moved = "".join(lines[:i] + lines[i + 1:]).replace("    preemption.defer()", lines[i] + "    preemption.defer()")
    assert any("out of order" in p for p in problems(moved))


def test_the_calls_that_stand_for_the_sequence_make_it_in_order():
    """`start_run` chooses the checkpoint, then plans the global batch from it; `build_loaders` sizes
    the training sampler to that global batch (the aliases above are true)."""
    run = (ROOT / "common/training/run.py").read_text()
    start = run.index("def start_run(")
    body = run[start:run.index("\ndef ", start + 1)]
    assert body.index("choose_checkpoint(") < body.index("global_batch_plan(")
    data = (ROOT / "common/data/loading.py").read_text()
    build = data[data.index("def build_loaders("):]
    assert "multiple_of=global_batch" in build


def named_recipe_literals(source: str) -> list[str]:
    """Calls in `source` that name a recipe with a string (`recipe="best_rq"`): a copied folder
    would write the name of the one it was copied from (its model card, its run.json)."""
    return [f"line {n.lineno}: {called(n)}(recipe={k.value.value!r})" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) for k in n.keywords
            if k.arg == "recipe" and isinstance(k.value, ast.Constant)]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_recipe_takes_its_name_from_its_folder(script):
    """`cp -r recipes/best_rq recipes/my_ssl`: the copy's model card says `my_ssl model` and
    `recipes/my_ssl/train.py` (was: `write_model_card(..., recipe="best_rq")` in every copy)."""
    assert named_recipe_literals(script.read_text()) == []
    assert named_recipe_literals('write_model_card(folder, recipe="best_rq", state=state)') == [
        "line 1: write_model_card(recipe='best_rq')"]  # the check can fail


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_recipe_that_validates_can_stop_early(script):
    """Every recipe that validates makes its stopper before the resume (which restores it), tells it
    each validation inside the loop, and exports with its kept weights (common/training/early_stopping.py)."""
    tree = ast.parse(script.read_text())
    calls = {}  # name -> the line of its first call
    for n in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        calls[called(n)] = min(calls.get(called(n), n.lineno), n.lineno)
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.iter, ast.Call)
                and called(n.iter) == "train_batches")
    assert "validation_due" in calls
    assert calls.get("start_early_stopping", 1e9) < calls["resume_from_checkpoint"]
    assert "after_validation" in {called(n) for n in ast.walk(loop) if isinstance(n, ast.Call)}
    assert "kept_weights" in calls
