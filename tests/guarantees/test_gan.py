"""Several models through the loop mechanics: a minimal GAN (tests/harness/support/gan_recipe: generator +
discriminator, two AdamW, two schedules, discriminator-only steps, accumulation) killed with SIGKILL
and re-launched ends bit-identical to a run never stopped, in 1 and 2 processes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.harness.harness import metrics, resumed_positions, run

pytestmark = pytest.mark.slow

GAN = "tests/harness/support/gan_recipe/train.py"


@pytest.mark.accelerate_launch
@pytest.mark.parametrize("nproc", [1, 2])
def test_gan_interrupted_equals_continuous(tmp_path, nproc):
    args = lambda out: ["--output_dir", str(out), "--gradient_accumulation_steps", "2", "--max_steps", "16"]  # noqa: E731
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run(GAN, nproc, args(cont), launcher=False)  # the reference: forked (the guarantee is the cut run's)
    run(GAN, nproc, args(cut), kill_after_checkpoint=3, launcher=nproc == 1)  # at 3: 3 discriminator updates, 1 generator update (harness.KILL_LEG)
    run(GAN, nproc, args(cut), kill_after_checkpoint=8, launcher=False)  # a middle leg: forked
    run(GAN, nproc, args(cut))

    # (a tiny step may save one more checkpoint before the kill lands)
    first, second = [step for step, _, _ in resumed_positions(tmp_path / "interrupted.log")]
    assert 3 <= first < 8 <= second < 16
    assert metrics(cut) == metrics(cont)  # both losses and both learning rates, every step once
    rows = metrics(cont)
    assert [r["step"] for r in rows] == list(range(1, 17))
    # steps 2, 4, ... update the generator too; its schedule moves on those only
    assert rows[0]["g_lr"] != rows[1]["g_lr"] == rows[2]["g_lr"] != rows[3]["g_lr"]
    assert len({r["epoch"] for r in rows}) > 1  # the run crossed an epoch
    for name in ("generator", "discriminator"):
        a, b = load_file(cont / "final" / name / "model.safetensors"), load_file(cut / "final" / name / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    saved = json.loads((cut / "checkpoints" / "step_00000016" / "train_state.json").read_text())
    assert saved["models"] == ["generator", "discriminator"] and set(saved["schedulers"]) == {"generator", "discriminator"}
    assert saved["registered"] == ["Balance", "RunState"]  # the recipe's own object, then the run's state
    assert [r["generator_updates"] for r in rows] == [s // 2 for s in range(1, 17)]

