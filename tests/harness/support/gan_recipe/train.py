"""A minimal GAN, the second shape the loop mechanics must take without edits to common/: a generator
and a discriminator (two models), two AdamW, two schedules, discriminator-only steps every other
step, gradient accumulation, through one Accelerator, and a state of its own registered for
checkpointing (`Balance`). Test-only (tests/guarantees/test_gan.py).

    accelerate launch tests/harness/support/gan_recipe/train.py --output_dir /tmp/gan

The data are fixed random 16-dim "frames" with made-up durations (so the duration batch sampler
makes uneven batches); the generator maps noise to frames. Exactness is the point, not quality.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import parse_config


@dataclass
class Config:
    """Every field can be set as --key value."""

    output_dir: str = "outputs/gan"
    utterances: int = 48  # items of the random training set
    dim: int = 16  # frame size
    noise_dim: int = 8  # generator input
    hidden: int = 32
    dropout: float = 0.1  # both models: the per-position reseed must reproduce the masks
    max_batch_seconds: float = 8.0  # padded "seconds" per batch, per process
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    max_nonfinite_updates: int = 5
    max_steps: int = 12  # optimizer steps (each updates the discriminator; every other one the generator too)
    gradient_accumulation_steps: int = 1
    seed: int = 42
    save_steps: int = 1
    save_total_limit: int = 3
    overwrite_output_dir: bool = False
    # Validation (the generator's distance to held-out frames) and early stopping, the shared fields' names
    eval_steps: int = 0  # optimizer steps between validations (0 = never)
    metric_for_best_model: str = "eval_loss"
    greater_is_better: bool | None = None
    early_stopping_patience: int = 0  # validations without improvement before the run stops (0 = never)
    early_stopping_threshold: float = 0.0


if __name__ == "__main__":
    CONFIG = parse_config(Config)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.training.checkpoint import export_final  # noqa: E402
from common.training.resume import choose_checkpoint, global_batch_plan, resume_from_checkpoint  # noqa: E402
from common.training.state import TrainState  # noqa: E402
from common.config import save_config  # noqa: E402
from common.data.loading import make_loader  # noqa: E402
from common.training.distributed import build_accelerator, seed_everything  # noqa: E402
from common.training.faults import Preemption, run_main  # noqa: E402
from common.training.logs import MetricsLog  # noqa: E402
from common.training.early_stopping import start_early_stopping  # noqa: E402
from common.training.loop import (end_step, no_sync_unless, optimizer_update, save_or_preempt,  # noqa: E402
                                  train_batches, validation_due)
from common.training.rundir import claim_output_dir  # noqa: E402


class Frames(torch.utils.data.Dataset):
    def __init__(self, cfg: Config):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(cfg.utterances, cfg.dim, generator=g) * 0.5 + 1.0  # (N, dim)
        self.durations = (1.0 + 2.0 * torch.rand(cfg.utterances, generator=g)).tolist()  # "seconds"

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return str(i), self.x[i]


def collate(items):
    return {"ids": [i for i, _ in items], "real": torch.stack([x for _, x in items])}


class Balance:
    """The recipe's own state, registered with the Accelerator without any edit to common/: the
    generator updates made so far and a running mean of the discriminator loss, both logged every step
    (a resume that lost them would log other values). Plain numbers in its state_dict, as a registered
    object must hold: the resume reads them back with torch.load(weights_only=True). The same on every
    rank (rank 0's is saved)."""

    def __init__(self):
        self.generator_updates, self.d_loss_mean = 0, 0.0

    def state_dict(self) -> dict:
        return {"generator_updates": self.generator_updates, "d_loss_mean": self.d_loss_mean}

    def load_state_dict(self, state: dict) -> None:
        self.generator_updates, self.d_loss_mean = state["generator_updates"], state["d_loss_mean"]


def mlp(n_in: int, hidden: int, n_out: int, dropout: float) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.LeakyReLU(0.2), torch.nn.Dropout(dropout),
                               torch.nn.Linear(hidden, n_out))


@torch.no_grad()
def evaluate(generator, cfg: Config) -> dict:
    """eval_loss: how far the mean of generated frames is from held-out frames' (fixed noise: no RNG drawn)."""
    g = torch.Generator().manual_seed(1)
    held_out = torch.randn(32, cfg.dim, generator=g) * 0.5 + 1.0
    generator.eval()
    fake = generator(torch.randn(32, cfg.noise_dim, generator=g))
    generator.train()
    return {"eval_loss": (fake.mean(0) - held_out.mean(0)).abs().mean().item()}


def main(cfg: Config) -> None:
    out = Path(cfg.output_dir)
    accelerator = build_accelerator(timeout_s=60.0)
    world = accelerator.num_processes
    claim_output_dir(accelerator, out, "gan_recipe", cfg.overwrite_output_dir)
    preemption = Preemption(accelerator)
    seed_everything(cfg.seed)

    ckpt = choose_checkpoint(accelerator, out)
    accumulation, global_batch = global_batch_plan(ckpt, world, cfg.gradient_accumulation_steps,
                                                   accelerator.is_main_process)
    data = Frames(cfg)
    loader, sampler = make_loader(data, data.durations, collate, max_batch_seconds=cfg.max_batch_seconds,
                                  num_buckets=3, seed=cfg.seed, multiple_of=global_batch, shuffle=True)

    generator = mlp(cfg.noise_dim, cfg.hidden, cfg.dim, cfg.dropout)
    discriminator = mlp(cfg.dim, cfg.hidden, 1, cfg.dropout)
    g_opt = torch.optim.AdamW(generator.parameters(), lr=cfg.learning_rate, betas=(0.5, 0.9))
    d_opt = torch.optim.AdamW(discriminator.parameters(), lr=cfg.learning_rate, betas=(0.5, 0.9))
    # Two schedules: the discriminator's decays every step, the generator's on its own updates only.
    d_sched = torch.optim.lr_scheduler.LambdaLR(d_opt, lambda s: 0.97 ** s)
    g_sched = torch.optim.lr_scheduler.LambdaLR(g_opt, lambda s: 1.0 / (1 + 0.1 * s))
    generator, discriminator, g_opt, d_opt, loader = accelerator.prepare(generator, discriminator, g_opt, d_opt, loader)

    parts = dict(models={"generator": generator, "discriminator": discriminator},
                 optimizers={"generator": g_opt, "discriminator": d_opt},
                 schedulers={"generator": g_sched, "discriminator": d_sched})
    balance = Balance()
    accelerator.register_for_checkpointing(balance)  # before the resume: it loads it
    stopper = start_early_stopping(accelerator, cfg, ckpt, parts["models"])  # registered when on: before the resume too
    state = TrainState.for_run(cfg, world, accumulation)
    resume_from_checkpoint(accelerator, ckpt, state, **parts)
    metrics = MetricsLog(accelerator, out / "metrics.jsonl", resume_step=state.step)

    preemption.defer()
    generator.train()
    discriminator.train()
    critic = accelerator.unwrap_model(discriminator)  # the generator's loss reaches D outside DDP: no D reduction
    window = torch.zeros(2)  # discriminator, generator loss: window means
    for batch, micro in train_batches(accelerator, loader, state, max_steps=cfg.max_steps, accumulation=accumulation,
                                      seed=cfg.seed, epoch_objects=(sampler,)):
        update_g = state.step % 2 == 1  # discriminator-only steps in between; the same on every rank
        real = batch["real"]
        with no_sync_unless(accelerator, (generator, discriminator), micro.sync):
            with torch.set_grad_enabled(update_g):
                fake = generator(torch.randn(len(real), cfg.noise_dim))  # noise: reseeded from the position
            scores = discriminator(torch.cat([real, fake.detach()]))  # (2B, 1)
            d_loss = F.softplus(-scores[: len(real)]).mean() + F.softplus(scores[len(real):]).mean()
            accelerator.backward(d_loss / micro.window_len)
            g_loss = torch.zeros(())
            if update_g:  # into the generator only: D's gradients are its own loss's
                g_loss = F.softplus(-critic(fake)).mean() + (fake.mean(0) - real.mean(0)).abs().mean()
                accelerator.backward(g_loss / micro.window_len, inputs=list(generator.parameters()))
        window += torch.stack([d_loss.detach(), g_loss.detach()]) / micro.window_len
        if not micro.sync:
            continue
        optimizer_update(accelerator, discriminator, d_opt, state, max_grad_norm=cfg.max_grad_norm,
                         max_nonfinite_updates=cfg.max_nonfinite_updates)
        if update_g:
            optimizer_update(accelerator, generator, g_opt, state, max_grad_norm=cfg.max_grad_norm,
                             max_nonfinite_updates=cfg.max_nonfinite_updates)
        end_step(state, d_sched, *([g_sched] if update_g else []))
        means = accelerator.reduce(window, "mean").tolist()  # collective: the same on every rank
        balance.generator_updates += update_g
        balance.d_loss_mean = 0.9 * balance.d_loss_mean + 0.1 * means[0]
        row = {}
        if validation_due(state, cfg.eval_steps, cfg.max_steps):
            row = evaluate(accelerator.unwrap_model(generator), cfg)  # the same on every rank
            stopper.after_validation(state, row)  # collective
        metrics.log({"step": state.step, "epoch": state.epoch, "loss": means[0], "g_loss": means[1],
                     "d_lr": d_sched.get_last_lr()[0], "g_lr": g_sched.get_last_lr()[0],
                     "d_loss_mean": balance.d_loss_mean, "generator_updates": balance.generator_updates, **row})
        window.zero_()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)

    with stopper.kept_weights():  # with early stopping on: the best validation's weights
        export_final(accelerator, parts["models"], out, lambda folder: save_config(cfg, folder / "config.yaml"))
    accelerator.end_training()


if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
