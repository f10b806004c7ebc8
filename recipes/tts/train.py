"""Non-autoregressive TTS with a learned aligner (FastSpeech-style + Badlani et al. 2021), with
Hugging Face Accelerate.

    # built-in single-voice espeak-ng corpus (LJSpeech layout), 1 process (CPU or one GPU)
    accelerate launch recipes/tts/train.py
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/tts/train.py
    # the real LJSpeech
    accelerate launch recipes/tts/train.py --data_dir /data/LJSpeech-1.1 --num_valid 100 --num_test 500
    # then
    python recipes/tts/synthesize.py --checkpoint outputs/tts --text "a radio wrote this clever pencil" --output out.wav
    python recipes/tts/evaluate.py --checkpoint outputs/tts --split test

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see README "Resume").
Outputs: <output_dir>/final/{model.safetensors, config.yaml, symbols.json}, <output_dir>/metrics.jsonl.
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
from common.data import DurationBatchSampler, load_audio
from common.distributed import build_accelerator, derive_seed, seed_everything
from common.faults import PREEMPTED_EXIT_CODE, Preemption, run_main
from common.features import feature_stats, shared_feature_stats
from common.logs import MetricsLog, get_logger, progress_bar
from common.manifest import DataPolicy, prepare_manifest

# recipe-local modules (this folder is on sys.path)
from audio import GriffinLim, mel_frontend, stack_images, to_image
from model import NEG, AlignedFastSpeech, Symbols, beta_binomial_prior

logger = get_logger(__name__)

LOSSES = ("mel_loss", "dur_loss", "align_loss", "bin_loss")


@dataclass
class Config:
    """TTS training. Every field can be set in the YAML (--config) or as --key value."""

    # --- data ---
    data_dir: str | None = None  # LJSpeech-layout root (wavs/ + metadata.csv); None = built-in corpus
    builtin_corpus: str = "default"  # built-in corpus profile when data_dir is None ("default" | "tiny")
    data_cache_dir: str | None = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    num_valid: int = 20  # utterances for validation: the num_valid ids just before the test ids
    num_test: int = 20  # held-out utterances for evaluate.py: the last num_test ids (sorted)
    symbols: str = " abcdefghijklmnopqrstuvwxyz'.,;:?!-\"()"  # characters; text is lowercased first
    sample_rate: int = 22050  # Hz
    wrong_sample_rate: str = "resample"  # audio at another rate: "resample" (on load) | "refuse"
    min_seconds: float = 0.5  # shorter utterances are refused by the data check
    max_seconds: float = 15.0  # longer utterances are refused by the data check
    on_bad_data: str = "error"  # unusable entries: "error" (stop with a report) | "skip" (drop, log counts)
    n_mels: int = 80  # log-mel bins (HTK scale, 0 Hz to Nyquist)
    win_length: int = 1024  # samples (46 ms); n_fft is the next power of two ≥ it
    hop_length: int = 256  # samples (11.6 ms per frame)
    max_batch_seconds: float = 40.0  # padded seconds of audio per batch, per process
    num_buckets: int = 10  # duration buckets for batching
    num_workers: int = 0  # DataLoader workers per process (results do not depend on it)
    stats_utterances: int = 500  # training utterances used for the global mean/std of log-mels
    # --- model ---
    dim: int = 128  # encoder/decoder width
    encoder_layers: int = 2  # FFT blocks over symbols
    decoder_layers: int = 2  # FFT blocks over frames
    num_heads: int = 2
    ffn_dim: int = 512  # conv feed-forward channels
    conv_kernel: int = 3  # feed-forward conv kernel (symbols / frames)
    dropout: float = 0.1
    duration_channels: int = 128  # duration predictor conv channels
    attention_dim: int = 80  # aligner key/query dimension
    attention_temperature: float = 0.0005  # score = −temperature · squared distance
    prior_scaling: float = 1.0  # ω of the beta-binomial prior (larger = sharper diagonal)
    blank_logprob: float = -1.0  # score of the CTC blank column in the forward-sum loss
    # --- losses ---
    duration_loss_weight: float = 0.1
    align_loss_weight: float = 1.0  # forward-sum loss
    binarization_loss_weight: float = 1.0
    binarization_start_steps: int = 300  # optimizer steps before the binarization loss is switched on
    # --- optimization ---
    learning_rate: float = 1e-3  # peak LR after warm-up
    warmup_steps: int = 100  # optimizer steps of linear warm-up, then LR ∝ 1/sqrt(step)
    weight_decay: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    max_grad_norm: float = 1.0
    max_nonfinite_updates: int = 5  # consecutive NaN/Inf gradient updates skipped before the run stops
    max_steps: int = 1000  # optimizer steps
    gradient_accumulation_steps: int = 1  # batches per optimizer step
    seed: int = 42
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16"
    ddp_timeout: float = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- logging / checkpoints ---
    output_dir: str = "outputs/tts"
    logging_steps: int = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: int = 250  # optimizer steps between validation passes (0 = never)
    save_steps: int = 250  # optimizer steps between checkpoints
    save_total_limit: int = 2  # complete checkpoints kept (oldest pruned after a new one is complete)
    report_to: str = "tensorboard"  # accelerate tracker ("tensorboard", "none", ...)
    num_samples: int = 2  # fixed validation sentences synthesized into TensorBoard at each validation
    griffin_lim_iters: int = 32  # Griffin-Lim iterations for those samples


def split_manifest(manifest, num_valid: int, num_test: int):
    """Deterministic split by sorted id: the last num_test ids are test, the num_valid before them
    validation, the rest training."""
    n = len(manifest)
    n_train = n - num_valid - num_test
    if n_train < 1:
        raise ValueError(f"{n} utterances leave none for training (num_valid {num_valid}, num_test {num_test})")
    return {"train": manifest.select(range(n_train)), "validation": manifest.select(range(n_train, n - num_test)),
            "test": manifest.select(range(n - num_test, n))}


def build_model(cfg: Config) -> AlignedFastSpeech:
    return AlignedFastSpeech(
        n_symbols=len(Symbols(cfg.symbols)), n_mels=cfg.n_mels, dim=cfg.dim, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, heads=cfg.num_heads, ffn_dim=cfg.ffn_dim, kernel=cfg.conv_kernel,
        dropout=cfg.dropout, duration_channels=cfg.duration_channels, attention_dim=cfg.attention_dim,
        attention_temperature=cfg.attention_temperature, blank_logprob=cfg.blank_logprob)


class TTSDataset(torch.utils.data.Dataset):
    """Manifest row → (id, symbol ids (N,), log-mel (frames, n_mels))."""

    def __init__(self, manifest, cfg: Config):
        self.manifest = manifest
        self.symbols = Symbols(cfg.symbols)
        self.sample_rate = cfg.sample_rate
        self.logmel = mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length)

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        row = self.manifest[i]
        tokens = torch.tensor(self.symbols.encode(row["text"]))
        mel = self.logmel(load_audio(row["path"], self.sample_rate))
        if mel.shape[0] < len(tokens):
            raise ValueError(f"{row['id']}: {mel.shape[0]} frames cannot hold {len(tokens)} symbols")
        return row["id"], tokens, mel


class Collator:
    """Pads a batch and adds the static beta-binomial prior (log) of each (frames, symbols) pair."""

    def __init__(self, cfg: Config):
        self.scaling = cfg.prior_scaling
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def log_prior(self, T: int, N: int) -> torch.Tensor:
        if (T, N) not in self.cache:
            self.cache[(T, N)] = torch.log(beta_binomial_prior(T, N, self.scaling) + 1e-8)
        return self.cache[(T, N)]

    def __call__(self, items):
        text_lens = torch.tensor([len(t) for _, t, _ in items])
        mel_lens = torch.tensor([m.shape[0] for _, _, m in items])
        B, N, T = len(items), int(text_lens.max()), int(mel_lens.max())
        tokens = torch.zeros(B, N, dtype=torch.long)
        mels = torch.zeros(B, T, items[0][2].shape[1])
        log_prior = torch.full((B, T, N), NEG)
        for b, (_, t, m) in enumerate(items):
            tokens[b, : len(t)] = t
            mels[b, : m.shape[0]] = m
            log_prior[b, : m.shape[0], : len(t)] = self.log_prior(m.shape[0], len(t))
        return dict(ids=[i for i, _, _ in items], tokens=tokens, text_lens=text_lens, mels=mels,
                    mel_lens=mel_lens, log_prior=log_prior)


def make_loader(dataset, durations, cfg: Config, world_size: int, shuffle: bool):
    sampler = DurationBatchSampler(durations, cfg.max_batch_seconds, num_buckets=cfg.num_buckets, shuffle=shuffle,
                                   seed=cfg.seed, world_size=world_size)
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=Collator(cfg), num_workers=cfg.num_workers,
        # Its own generator: creating an iterator must not draw from the global torch RNG
        # (a resumed run creates its iterator at a different point; ACCELERATE_NOTES #3).
        generator=torch.Generator().manual_seed(cfg.seed), persistent_workers=False,
    )
    return loader, sampler


def inverse_sqrt_schedule(warmup_steps: int):
    """Linear warm-up to 1, then 1/sqrt decay; independent of max_steps (extending a run is exact)."""
    def f(step: int) -> float:
        step = max(step, 1)
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))
    return f


def total_loss(out: dict, cfg: Config, binarize: bool) -> torch.Tensor:
    loss = out["mel_loss"] + cfg.duration_loss_weight * out["dur_loss"] + cfg.align_loss_weight * out["align_loss"]
    return loss + cfg.binarization_loss_weight * out["bin_loss"] if binarize else loss


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Teacher-forced losses on the validation set (each utterance once), weighted by utterances."""
    model.eval()
    totals = torch.zeros(len(LOSSES) + 1, device=accelerator.device)
    for batch in loader:
        out = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"], batch["log_prior"], False)
        n = float(len(batch["ids"]))
        totals += torch.tensor([out[k].item() * n for k in LOSSES] + [n], device=accelerator.device)
    totals = accelerator.reduce(totals, "sum")
    model.train()
    return {f"eval_{k}": (totals[i] / totals[-1]).item() for i, k in enumerate(LOSSES)}


@torch.no_grad()
def log_samples(model, dataset, cfg: Config, writer, vocoder, step: int) -> None:
    """Main process only: predicted vs target mel, the soft and hard alignment, and Griffin-Lim
    audio of the first `num_samples` validation sentences (no collectives in here)."""
    model.eval()
    collate = Collator(cfg)
    for i in range(min(cfg.num_samples, len(dataset))):
        utt_id, tokens, mel = dataset[i]
        batch = collate([dataset[i]])
        out = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"], batch["log_prior"], False)
        pred, lens, _ = model.infer(tokens[None], torch.tensor([len(tokens)]))
        pred = pred[0, : int(lens[0])]
        lo, hi = float(mel.min()), float(mel.max())
        images = [to_image(pred, lo, hi), to_image(out["pred"][0], lo, hi), to_image(mel, lo, hi)]
        writer.add_image(f"mel/{i}_synth_teacher_forced_target", stack_images(images)[None], step)
        align = stack_images([to_image(out["soft"][0], 0, 1), to_image(out["hard"][0], 0, 1)])
        writer.add_image(f"alignment/{i}_soft_hard", align[None], step)  # symbols up, frames right
        writer.add_audio(f"audio/{i}", vocoder(pred)[None], step, sample_rate=cfg.sample_rate)
        if step == cfg.eval_steps:  # the recording, once
            writer.add_audio(f"audio/{i}_recording", load_audio(dataset.manifest[i]["path"], cfg.sample_rate)[None],
                             step, sample_rate=cfg.sample_rate)
    model.train()


def main():
    cfg = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))
    out = Path(cfg.output_dir)
    accelerator = build_accelerator(
        mixed_precision=cfg.mixed_precision, project_dir=str(out),
        log_with=None if cfg.report_to == "none" else cfg.report_to, timeout_s=cfg.ddp_timeout,
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    out.mkdir(parents=True, exist_ok=True)  # every rank: idempotent
    seed_everything(cfg.seed)  # model init: identical on every rank
    cfg_dict = config_to_dict(cfg)
    symbols = Symbols(cfg.symbols)

    # ---- data ------------------------------------------------------------------------------
    # The built-in corpus is generated once per cache folder (one process builds, the others wait).
    data_dir = cfg.data_dir or str(ensure_builtin_corpus(cfg.data_cache_dir, cfg.builtin_corpus) / "ljspeech")
    # Checked once per output_dir: bad audio, and characters outside the symbol table (either case).
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=cfg.symbols + cfg.symbols.upper(), on_bad_data=cfg.on_bad_data)
    manifest = prepare_manifest(out, "all", data_dir, policy, None, is_main_process=accelerator.is_main_process)
    splits = split_manifest(manifest, cfg.num_valid, cfg.num_test)
    train_set, valid_set = splits["train"], splits["validation"]
    logger.info(f"{len(train_set)} training utterances ({sum(train_set['duration']) / 3600:.2f} h), "
                f"{len(valid_set)} validation, {len(splits['test'])} test, {world} process(es)")
    train_ds, valid_ds = TTSDataset(train_set, cfg), TTSDataset(valid_set, cfg)
    train_loader, train_sampler = make_loader(train_ds, train_set["duration"], cfg, world, True)
    valid_loader, _ = make_loader(valid_ds, valid_set["duration"], cfg, world, False)

    # ---- model -----------------------------------------------------------------------------
    model = build_model(cfg)
    logger.info(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
                f"{len(symbols) - 1} symbols")

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
        def compute():
            stride = max(1, len(train_ds) // cfg.stats_utterances)
            return feature_stats([train_ds[i][2] for i in range(0, len(train_ds), stride)])
        mean, std = shared_feature_stats(accelerator, compute)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.feat_mean.copy_(mean)
        unwrapped.feat_std.copy_(std)
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        (out / "symbols.json").write_text(json.dumps({"symbols": cfg.symbols}) + "\n")
    metrics = MetricsLog(accelerator, out / "metrics.jsonl", resume_step=state.step)
    writer = vocoder = None
    if cfg.report_to != "none":
        accelerator.init_trackers("tensorboard", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                         for k, v in cfg_dict.items()})
        if accelerator.is_main_process and "tensorboard" in cfg.report_to:
            writer = accelerator.get_tracker("tensorboard", unwrap=True)  # the SummaryWriter
            vocoder = GriffinLim(mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length),
                                 n_iter=cfg.griffin_lim_iters)
    preemption = Preemption(accelerator)  # SIGTERM/SIGUSR1 → save at the next step boundary, exit 75

    # ---- training loop ----------------------------------------------------------------------
    accum = cfg.gradient_accumulation_steps
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    window = torch.zeros(len(LOSSES) + 1)  # loss, mel, dur, align, bin over the accumulation window
    while state.step < cfg.max_steps:
        # Set the epoch on every object that has one: accelerate does not reach our sampler in DDP.
        train_sampler.set_epoch(state.epoch)
        train_loader.set_epoch(state.epoch)
        n_batches = len(train_loader)  # this rank's batches; equal on every rank
        # Mid-epoch resume: drop the consumed batches' index lists, no audio is loaded for them.
        loader = skip_first_batches(train_loader, state.batches_in_epoch) if state.batches_in_epoch else train_loader
        for batch in loader:
            i = state.batches_in_epoch
            window_len = min(accum, n_batches - (i - i % accum))  # the epoch's last window may be short
            sync = (i + 1) % accum == 0 or i + 1 == n_batches
            # Dropout RNG as a pure function of the position: nothing about it is lost on a kill.
            torch.manual_seed(derive_seed(cfg.seed, "train", state.epoch, i, rank))
            binarize = state.step >= cfg.binarization_start_steps  # same on every rank
            ctx = contextlib.nullcontext() if sync else accelerator.no_sync(model)
            with ctx:
                out_ = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"],
                             batch["log_prior"], binarize)
                loss = total_loss(out_, cfg, binarize)
                accelerator.backward(loss / window_len)  # the mean over the window's batches
            window += torch.stack([loss.detach()] + [out_[k].detach() for k in LOSSES]).cpu() / window_len
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
                logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
                if writer is not None:  # main process only; no collectives inside
                    log_samples(accelerator.unwrap_model(model), valid_ds, cfg, writer, vocoder, state.step)
            if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
                # Collective (all ranks): mean over processes.
                means = accelerator.reduce(window.to(accelerator.device), "mean").tolist()
                row = {"step": state.step, "epoch": state.epoch, "loss": means[0],
                       **{k: means[j + 1] for j, k in enumerate(LOSSES)}, "lr": scheduler.get_last_lr()[0],
                       "grad_norm": grad_norm.item(), "skipped_updates": state.skipped_updates, **row}
                metrics.log(row)  # one line per logged step, main process only
                accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
                bar.set_postfix(loss=f"{row['loss']:.3f}", mel=f"{row['mel_loss']:.3f}")
            window = torch.zeros(len(LOSSES) + 1)
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
    accelerator.save_model(model, final)  # model.safetensors (incl. feature statistics), rank 0
    if accelerator.is_main_process:
        save_config(cfg, final / "config.yaml")
        (final / "symbols.json").write_text(json.dumps({"symbols": cfg.symbols}) + "\n")
        logger.info(f"final model in {final}")
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
