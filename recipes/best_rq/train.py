"""BEST-RQ self-supervised pre-training of a Conformer encoder, with Hugging Face Accelerate.

    # built-in espeak-ng corpus, 1 process (CPU or one GPU)
    accelerate launch recipes/best_rq/train.py
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/best_rq/train.py
    # LibriSpeech 960 h on GPUs, bf16
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/best_rq/train.py \
        --config recipes/best_rq/config_librispeech_960h.yaml --data_dir /data/LibriSpeech

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see README "Resume").
Outputs: <output_dir>/final/{model.safetensors, config.yaml, encoder/}, <output_dir>/metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import skip_first_batches
from torch.utils.data import DataLoader

from common.checkpoint import RESUME_SAFE_KEYS, TrainState, resume_from_checkpoint, save_checkpoint
from common.config import config_hash, config_to_dict, parse_config, save_config
from common.corpus import ensure_builtin_corpus
from common.data import DurationBatchSampler, load_audio, sample_generator
from common.distributed import build_accelerator, derive_seed, seed_everything
from common.faults import PREEMPTED_EXIT_CODE, Preemption, run_main
from common.features import LogMel, feature_stats, shared_feature_stats
from common.logs import MetricsLog, get_logger, progress_bar
from common.manifest import DataPolicy, prepare_manifest

from model import BestRQ, encoder_config, span_mask  # recipe-local (this folder is on sys.path)

logger = get_logger(__name__)


@dataclass
class Config:
    """BEST-RQ pre-training. Every field can be set in the YAML (--config) or as --key value."""

    # --- data ---
    data_dir: str | None = None  # LibriSpeech-layout root; None = the built-in espeak-ng corpus
    train_split: str = "train"  # subfolder(s) of data_dir, comma-separated (train-clean-100,train-other-500)
    valid_split: str = "validation"
    builtin_corpus: str = "default"  # built-in corpus profile when data_dir is None ("default" | "tiny")
    data_cache_dir: str | None = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    sample_rate: int = 16000  # Hz
    wrong_sample_rate: str = "resample"  # audio at another rate: "resample" (on load) | "refuse"
    min_seconds: float = 0.5  # shorter utterances are refused by the data check
    max_seconds: float = 30.0  # longer utterances are refused by the data check
    on_bad_data: str = "error"  # unusable entries: "error" (stop with a report) | "skip" (drop, log counts)
    n_mels: int = 80  # log-mel bins, 25 ms window, 10 ms hop
    max_batch_seconds: float = 60.0  # padded seconds of audio per batch, per process
    num_buckets: int = 10  # duration buckets for batching
    num_workers: int = 0  # DataLoader workers per process (results do not depend on it)
    stats_utterances: int = 500  # training utterances used for the global mean/std of log-mels
    # --- BEST-RQ ---
    stack_frames: int = 4  # 10 ms frames stacked per label / encoder frame (4 → 40 ms)
    codebook_size: int = 8192  # labels; chance-level loss is ln(codebook_size)
    code_dim: int = 16  # random-projection dimension
    quantizer_seed: int = 1234  # the quantizer depends on this seed only
    mask_prob: float = 0.01  # probability that a 40 ms position starts a masked span
    mask_span_ms: float = 400.0  # span length in ms (paper: 400)
    noise_std: float = 0.1  # masked frames are replaced with N(0, noise_std²) (normalized features)
    # --- encoder (Conformer, transformers Wav2Vec2BertModel) ---
    hidden_size: int = 144
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 576
    conv_kernel: int = 15  # depthwise convolution kernel, in 40 ms frames
    dropout: float = 0.1
    # --- optimization ---
    learning_rate: float = 2e-3  # peak LR after warm-up
    warmup_steps: int = 200  # optimizer steps of linear warm-up, then LR ∝ 1/sqrt(step)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    max_grad_norm: float = 5.0
    max_nonfinite_updates: int = 5  # consecutive NaN/Inf gradient updates skipped before the run stops
    max_steps: int = 1500  # optimizer steps
    gradient_accumulation_steps: int = 1  # batches per optimizer step
    seed: int = 42
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16"
    ddp_timeout: float = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- logging / checkpoints ---
    output_dir: str = "outputs/best_rq"
    logging_steps: int = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: int = 250  # optimizer steps between validation passes (0 = never)
    save_steps: int = 250  # optimizer steps between checkpoints
    save_total_limit: int = 2  # complete checkpoints kept (oldest pruned after a new one is complete)
    report_to: str = "tensorboard"  # accelerate tracker ("tensorboard", "none", ...)
    dump_batch_ids: bool = False  # write each rank's utterance ids per batch (audits DDP sharding)


class FeatureDataset(torch.utils.data.Dataset):
    """Manifest row → (id, log-mel (frames, n_mels) float32)."""

    def __init__(self, manifest, sample_rate: int, n_mels: int):
        self.manifest = manifest
        self.sample_rate = sample_rate
        self.logmel = LogMel(sample_rate, n_mels)

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        row = self.manifest[i]
        return row["id"], self.logmel(load_audio(row["path"], self.sample_rate))


class MaskingCollator:
    """Pads a batch and draws its masks and noise from (seed, epoch, utterance id) alone."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.span = max(1, round(cfg.mask_span_ms / (10 * cfg.stack_frames)))  # in 40 ms positions
        self.epoch = 0

    def __call__(self, items):
        s = self.cfg.stack_frames
        lens = torch.tensor([f.shape[0] // s * s for _, f in items])  # whole 40 ms positions only
        T = int(lens.max())
        feats = torch.zeros(len(items), T, self.cfg.n_mels)
        noise = torch.zeros_like(feats)
        mask = torch.zeros(len(items), T // s, dtype=torch.bool)
        for b, (utt_id, f) in enumerate(items):
            n = int(lens[b])
            g = sample_generator(self.cfg.seed, self.epoch, utt_id)
            feats[b, :n] = f[:n]
            mask[b, : n // s] = span_mask(n // s, self.cfg.mask_prob, self.span, g)
            noise[b, :n] = torch.randn(n, self.cfg.n_mels, generator=g) * self.cfg.noise_std
        return dict(ids=[i for i, _ in items], feats=feats, feat_lens=lens, mask=mask, noise=noise)


def make_loader(dataset, durations, cfg: Config, world_size: int, shuffle: bool):
    sampler = DurationBatchSampler(
        durations, cfg.max_batch_seconds, num_buckets=cfg.num_buckets, shuffle=shuffle,
        seed=cfg.seed, world_size=world_size,
    )
    collator = MaskingCollator(cfg)
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collator, num_workers=cfg.num_workers,
        # Its own generator: creating an iterator must not draw from the global torch RNG
        # (a resumed run creates its iterator at a different point; ACCELERATE_NOTES #3).
        generator=torch.Generator().manual_seed(cfg.seed),
        persistent_workers=False,
    )
    return loader, sampler, collator


def inverse_sqrt_schedule(warmup_steps: int):
    """Linear warm-up to 1, then 1/sqrt decay (the Transformer/Conformer schedule).

    It does not depend on max_steps, so extending a run on resume changes nothing before it."""
    def f(step: int) -> float:
        step = max(step, 1)
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))
    return f


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Masked-prediction loss and accuracy on the validation set (each utterance once)."""
    model.eval()
    totals = torch.zeros(3, device=accelerator.device)  # Σ loss·n, Σ acc·n, Σ n
    for batch in loader:
        loss, acc, n = model(batch["feats"], batch["feat_lens"], batch["mask"], batch["noise"])
        totals += torch.stack([loss * n, acc * n, n.float()])
    totals = accelerator.reduce(totals, "sum")
    model.train()
    return {"eval_loss": (totals[0] / totals[2]).item(), "eval_acc": (totals[1] / totals[2]).item()}


def main():
    cfg = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))
    out = Path(cfg.output_dir)
    accelerator = build_accelerator(
        mixed_precision=cfg.mixed_precision, project_dir=str(out),
        log_with=None if cfg.report_to == "none" else cfg.report_to, timeout_s=cfg.ddp_timeout,
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    out.mkdir(parents=True, exist_ok=True)  # every rank: idempotent, and no rank races another's mkdir
    seed_everything(cfg.seed)  # model init: identical on every rank
    cfg_dict = config_to_dict(cfg)

    # ---- data ------------------------------------------------------------------------------
    # The built-in corpus is generated once per cache folder; every rank (and node) calls this,
    # one builds under a file lock and the others wait for its completion marker.
    data_dir = cfg.data_dir or str(ensure_builtin_corpus(cfg.data_cache_dir, cfg.builtin_corpus) / "librispeech")
    # Checked once per output_dir (first process to arrive; the others wait): missing, corrupt,
    # empty, too short/long, multi-channel, wrong-rate audio, duplicate ids, malformed lines.
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=None, on_bad_data=cfg.on_bad_data)  # BEST-RQ uses no transcripts
    is_main = accelerator.is_main_process
    train_set = prepare_manifest(out, "train", data_dir, policy, cfg.train_split, is_main_process=is_main)
    valid_set = prepare_manifest(out, "valid", data_dir, policy, cfg.valid_split, is_main_process=is_main)
    logger.info(f"{len(train_set)} training utterances ({sum(train_set['duration']) / 3600:.2f} h), "
                f"{len(valid_set)} validation, {world} process(es)")
    train_ds = FeatureDataset(train_set, cfg.sample_rate, cfg.n_mels)
    train_loader, train_sampler, train_collator = make_loader(train_ds, train_set["duration"], cfg, world, True)
    valid_loader, _, _ = make_loader(
        FeatureDataset(valid_set, cfg.sample_rate, cfg.n_mels), valid_set["duration"], cfg, world, False)

    # ---- model -----------------------------------------------------------------------------
    enc_cfg = encoder_config(
        input_dim=cfg.n_mels * cfg.stack_frames, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, ffn_dim=cfg.ffn_dim, conv_kernel=cfg.conv_kernel, dropout=cfg.dropout)
    model = BestRQ(enc_cfg, n_mels=cfg.n_mels, stack_frames=cfg.stack_frames, codebook_size=cfg.codebook_size,
                   code_dim=cfg.code_dim, quantizer_seed=cfg.quantizer_seed)
    logger.info(f"encoder: {sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters")

    # ---- optimizer and schedule (sized in optimizer steps) -----------------------------------
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(cfg.warmup_steps))

    # The scheduler is not prepared: we step it once per optimizer step ourselves (accelerate #1382).
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)
    state = TrainState(world_size=world, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                       config_hash=config_hash(cfg_dict, ignore=RESUME_SAFE_KEYS), config=cfg_dict)
    accelerator.register_for_checkpointing(state, scheduler)

    # ---- resume, or start: global feature statistics (computed once, broadcast, checkpointed) --
    ckpt = resume_from_checkpoint(accelerator, out, state)
    if ckpt is not None:
        logger.info(f"resumed from {ckpt}: step {state.step}, epoch {state.epoch}, "
                    f"batch {state.batches_in_epoch} of the epoch")
    else:
        def compute():  # an evenly spaced subset: the manifest is sorted by speaker
            stride = max(1, len(train_ds) // cfg.stats_utterances)
            return feature_stats([train_ds[i][1] for i in range(0, len(train_ds), stride)])
        mean, std = shared_feature_stats(accelerator, compute)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.feat_mean.copy_(mean)
        unwrapped.feat_std.copy_(std)
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
    metrics = MetricsLog(accelerator, out / "metrics.jsonl", resume_step=state.step)
    if cfg.report_to != "none":
        accelerator.init_trackers("tensorboard", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                         for k, v in cfg_dict.items()})
    ids_log = open(out / f"batch_ids.rank{rank}.jsonl", "a") if cfg.dump_batch_ids else None
    preemption = Preemption(accelerator)  # SIGTERM/SIGUSR1 → save at the next step boundary, exit 75

    # ---- training loop ----------------------------------------------------------------------
    logger.info(f"chance level: ln({cfg.codebook_size}) = {math.log(cfg.codebook_size):.3f}")
    accum = cfg.gradient_accumulation_steps
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    window_loss = window_acc = 0.0
    while state.step < cfg.max_steps:
        # Set the epoch on every object that has one: accelerate does not reach our sampler in
        # DDP, and its own epoch counter is not checkpointed (ACCELERATE_NOTES).
        train_sampler.set_epoch(state.epoch)
        train_loader.set_epoch(state.epoch)
        train_collator.epoch = state.epoch
        n_batches = len(train_loader)  # this rank's batches; equal on every rank
        # Mid-epoch resume: drop the consumed batches' index lists, no audio is loaded for them.
        loader = skip_first_batches(train_loader, state.batches_in_epoch) if state.batches_in_epoch else train_loader
        for batch in loader:
            i = state.batches_in_epoch
            window_len = min(accum, n_batches - (i - i % accum))  # the epoch's last window may be short
            sync = (i + 1) % accum == 0 or i + 1 == n_batches
            # Dropout RNG as a pure function of the position: nothing about it is lost on a kill.
            torch.manual_seed(derive_seed(cfg.seed, "train", state.epoch, i, rank))
            if ids_log:
                ids_log.write(json.dumps({"epoch": state.epoch, "batch": i, "ids": batch["ids"]}) + "\n")
                ids_log.flush()
            ctx = contextlib.nullcontext() if sync else accelerator.no_sync(model)
            with ctx:
                loss, acc, _ = model(batch["feats"], batch["feat_lens"], batch["mask"], batch["noise"])
                accelerator.backward(loss / window_len)  # the mean over the window's batches
            window_loss += loss.detach() / window_len
            window_acc += acc.detach() / window_len
            state.batches_in_epoch += 1
            if not sync:
                continue

            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            # Gradients were all-reduced, so every rank sees the same norm and takes the same branch.
            if torch.isfinite(grad_norm):
                optimizer.step()
                state.nonfinite_streak = 0
            else:
                state.skipped_updates += 1
                state.nonfinite_streak += 1
                logger.warning(f"step {state.step + 1}: non-finite gradient norm, update skipped "
                               f"({state.nonfinite_streak} in a row, {state.skipped_updates} in total)")
                if state.nonfinite_streak >= cfg.max_nonfinite_updates:
                    raise FloatingPointError(f"{state.nonfinite_streak} consecutive non-finite updates; "
                                             f"stopping (last good checkpoint kept). Lower --learning_rate?")
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            if state.batches_in_epoch == n_batches:  # a checkpoint taken now resumes at the next epoch
                state.epoch += 1
                state.batches_in_epoch = 0
            bar.update(1)

            row = {}
            if cfg.eval_steps and state.step % cfg.eval_steps == 0:
                row = evaluate(model, valid_loader, accelerator)  # collective
                logger.info(f"step {state.step}: eval_loss {row['eval_loss']:.3f}, eval_acc {row['eval_acc']:.3f}")
            if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
                # Collective (all ranks): mean over processes.
                loss_acc = accelerator.reduce(torch.stack([window_loss, window_acc]).float(), "mean")
                row = {"step": state.step, "epoch": state.epoch, "loss": loss_acc[0].item(),
                       "acc": loss_acc[1].item(), "lr": scheduler.get_last_lr()[0],
                       "grad_norm": grad_norm.item(), "skipped_updates": state.skipped_updates, **row}
                metrics.log(row)  # one line per logged step, main process only
                accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}")
            window_loss = window_acc = 0.0
            stop = preemption.requested()  # collective: all ranks agree on the same step
            if state.step % cfg.save_steps == 0 or state.step == cfg.max_steps or stop:
                save_checkpoint(accelerator, out, state, cfg.save_total_limit)  # collective
            if stop:
                logger.warning(f"preempted at step {state.step}: checkpoint saved; re-run the same "
                               f"command to resume (exit code {PREEMPTED_EXIT_CODE})")
                accelerator.end_training()
                sys.exit(PREEMPTED_EXIT_CODE)
            if state.step >= cfg.max_steps:
                break
    bar.close()

    # ---- export ---------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    final = out / "final"
    accelerator.save_model(model, final)  # model.safetensors (incl. quantizer, feature stats), rank 0
    if accelerator.is_main_process:
        save_config(cfg, final / "config.yaml")
        accelerator.unwrap_model(model).encoder.save_pretrained(final / "encoder")
        logger.info(f"final model in {final}")
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
