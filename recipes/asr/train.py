"""Conformer-CTC speech recognition, from scratch or fine-tuned from BEST-RQ, with Hugging Face Accelerate.

    # built-in espeak-ng corpus, characters, 1 process (CPU or one GPU)
    accelerate launch recipes/asr/train.py
    # fine-tune a BEST-RQ encoder (same front end and encoder shape)
    accelerate launch recipes/asr/train.py --init_from outputs/best_rq --output_dir outputs/asr_ft
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/asr/train.py
    # LibriSpeech 100 h, BPE, GPUs
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/asr/train.py \
        --config recipes/asr/config_librispeech_100h.yaml --data_dir /data/LibriSpeech
    # word and character error rates on the test split
    accelerate launch recipes/asr/evaluate.py --checkpoint outputs/asr --split test

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see the top README "Resume").
Outputs: <output_dir>/final/{model.safetensors, config.yaml, tokenizer/}, <output_dir>/metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torchaudio
from accelerate import skip_first_batches
from torch.utils.data import DataLoader

from common.checkpoint import RESUME_SAFE_KEYS, TrainState, resume_from_checkpoint, save_checkpoint
from common.config import config_hash, config_to_dict, parse_config, save_config
from common.corpus import ensure_builtin_corpus
from common.data import DurationBatchSampler, sample_generator
from common.distributed import build_accelerator, derive_seed, seed_everything
from common.faults import PREEMPTED_EXIT_CODE, Preemption, run_main
from common.features import LogMel, feature_stats, shared_feature_stats
from common.logs import MetricsLog, get_logger, progress_bar
from common.manifest import DataPolicy, prepare_manifest
from common.prepare import prepare_once

# recipe-local modules (this folder is on sys.path)
from ctc_decode import ctc_decode
from manifest import labelled_subset, load_wav, read_split
from model import ConformerCTC, ctc_loss, encoder_config, load_best_rq, spec_augment_masks
from scoring import Scorer, gather_results
from text import build_tokenizer, load_tokenizer, normalize_text

logger = get_logger(__name__)


@dataclass
class Config:
    """Conformer-CTC ASR. Every field can be set in the YAML (--config) or as --key value."""

    # --- data ---
    data_dir: str | None = None  # LibriSpeech-layout root or datasets.save_to_disk folder (manifest.py); None = built-in corpus
    train_split: str = "train"  # subfolder(s) of data_dir, comma-separated (train-clean-100,train-clean-360)
    valid_split: str = "validation"
    builtin_corpus: str = "default"  # built-in corpus profile when data_dir is None ("default" | "tiny")
    data_cache_dir: str | None = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    train_fraction: float = 1.0  # labelled subset: the round(fraction·N) training utterances whose ids hash lowest
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
    # --- output tokens ---
    token_type: str = "char"  # "char" (a-z, ', space) | "bpe" (SentencePiece, trained on the training transcripts)
    bpe_vocab_size: int = 256  # SentencePiece pieces (an upper bound: a small corpus may give fewer)
    # --- augmentation (a pure function of (seed, epoch, utterance id)) ---
    speed_perturb: float = 0.0  # speed factor drawn from {1-x, 1, 1+x} per utterance and epoch (0 = off)
    freq_masks: int = 2  # SpecAugment frequency masks per utterance
    freq_mask_width: int = 27  # mel bins, maximum width of each
    time_masks: int = 2  # SpecAugment time masks per utterance
    time_mask_width: int = 40  # 10 ms frames, maximum width of each ...
    time_mask_ratio: float = 0.2  # ... and at most this fraction of the utterance
    # --- encoder (Conformer, transformers Wav2Vec2BertModel; must match BEST-RQ for --init_from) ---
    stack_frames: int = 4  # 10 ms frames stacked per encoder frame (4 → 40 ms per CTC frame)
    hidden_size: int = 144
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 576
    conv_kernel: int = 15  # depthwise convolution kernel, in 40 ms frames
    dropout: float = 0.1
    # --- fine-tuning ---
    init_from: str | None = None  # BEST-RQ output_dir or its final/: encoder and feature statistics
    encoder_lr_scale: float = 1.0  # encoder LR = learning_rate × this (head: learning_rate)
    freeze_encoder_steps: int = 0  # optimizer steps during which the encoder is not updated
    # --- optimization ---
    learning_rate: float = 2e-3  # peak LR after warm-up
    warmup_steps: int = 200  # optimizer steps of linear warm-up, then LR ∝ 1/sqrt(step)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    max_grad_norm: float = 5.0
    max_nonfinite_updates: int = 5  # consecutive NaN/Inf gradient updates skipped before the run stops
    max_steps: int = 1000  # optimizer steps
    gradient_accumulation_steps: int = 1  # batches per optimizer step
    seed: int = 42
    mixed_precision: str = "no"  # "no" | "bf16" | "fp16"
    ddp_timeout: float = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- logging / checkpoints ---
    output_dir: str = "outputs/asr"
    logging_steps: int = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: int = 250  # optimizer steps between validation passes (loss, greedy WER/CER; 0 = never)
    save_steps: int = 250  # optimizer steps between checkpoints
    save_total_limit: int = 2  # complete checkpoints kept (oldest pruned after a new one is complete)
    report_to: str = "tensorboard"  # accelerate tracker ("tensorboard", "none", ...)
    dump_batch_ids: bool = False  # write each rank's utterance ids per batch (audits DDP sharding)


class SpeechDataset(torch.utils.data.Dataset):
    """Manifest row → (id, log-mel (frames, n_mels), token ids, normalized transcript).

    Speed perturbation (resampling: tempo and pitch, as in Kaldi) is drawn from (seed, epoch, id)."""

    def __init__(self, manifest, cfg: Config, tokenizer, speed_perturb: float = 0.0):
        self.manifest, self.cfg, self.tokenizer, self.speed_perturb = manifest, cfg, tokenizer, speed_perturb
        self.logmel = LogMel(cfg.sample_rate, cfg.n_mels)
        self.epoch = 0

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        row = self.manifest[i]
        wav = load_wav(row, self.cfg.sample_rate)
        if self.speed_perturb:
            g = sample_generator(self.cfg.seed, self.epoch, f"{row['id']}/speed")
            factor = (1 - self.speed_perturb, 1.0, 1 + self.speed_perturb)[int(torch.randint(3, (1,), generator=g))]
            if factor != 1.0:  # played `factor` times faster: fewer samples
                sr = self.cfg.sample_rate
                wav = torchaudio.functional.resample(wav, round(sr * factor), sr)
        return row["id"], self.logmel(wav), self.tokenizer.encode(row["text"]), normalize_text(row["text"])


class SpecAugmentCollator:
    """Pads a batch and draws its SpecAugment masks from (seed, epoch, utterance id) alone."""

    def __init__(self, cfg: Config, augment: bool):
        self.cfg, self.augment = cfg, augment
        self.epoch = 0

    def __call__(self, items):
        c, s = self.cfg, self.cfg.stack_frames
        lens = torch.tensor([f.shape[0] // s * s for _, f, _, _ in items])  # whole 40 ms frames only
        T = max(int(lens.max()), s)
        feats = torch.zeros(len(items), T, c.n_mels)
        time_mask = torch.zeros(len(items), T, dtype=torch.bool)
        freq_mask = torch.zeros(len(items), c.n_mels, dtype=torch.bool)
        for b, (utt_id, f, _, _) in enumerate(items):
            n = int(lens[b])
            feats[b, :n] = f[:n]
            if self.augment:
                g = sample_generator(c.seed, self.epoch, utt_id)
                time_mask[b, :n], freq_mask[b] = spec_augment_masks(
                    n, c.n_mels, g, freq_masks=c.freq_masks, freq_mask_width=c.freq_mask_width,
                    time_masks=c.time_masks, time_mask_width=c.time_mask_width, time_mask_ratio=c.time_mask_ratio)
        return dict(ids=[i for i, _, _, _ in items], feats=feats, feat_lens=lens, time_mask=time_mask,
                    freq_mask=freq_mask, targets=torch.tensor([t for _, _, tok, _ in items for t in tok], dtype=torch.long),
                    target_lens=torch.tensor([len(tok) for _, _, tok, _ in items]), texts=[t for *_, t in items])


def make_loader(dataset, durations, cfg: Config, world_size: int, shuffle: bool, max_batch_seconds: float | None = None):
    sampler = DurationBatchSampler(
        durations, max_batch_seconds or cfg.max_batch_seconds, num_buckets=cfg.num_buckets, shuffle=shuffle,
        seed=cfg.seed, world_size=world_size,
    )
    collator = SpecAugmentCollator(cfg, augment=shuffle)  # augment the training set only
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
def transcribe(model, loader, tokenizer, decoding: str = "greedy", beam_size: int = 8):
    """Decode this process's share of `loader` → ([(id, hyp, ref)], Σ CTC loss, Σ target tokens)."""
    model.eval()
    results, loss_sum, tokens = [], 0.0, 0
    for batch in loader:
        log_probs, out_lens = model(batch["feats"], batch["feat_lens"])
        n = int(batch["target_lens"].sum())
        loss_sum += ctc_loss(log_probs, out_lens, batch["targets"], batch["target_lens"]).item() * n
        tokens += n
        hyps = ctc_decode(log_probs, out_lens, decoding, beam_size)
        results += [(i, tokenizer.decode(h), r) for i, h, r in zip(batch["ids"], hyps, batch["texts"])]
    model.train()
    return results, loss_sum, tokens


def evaluate(model, loader, accelerator, tokenizer, scorer) -> dict:
    """Validation CTC loss (every rank) and greedy WER/CER (main process), each utterance once.
    Collective: call on every rank."""
    results, loss_sum, tokens = transcribe(model, loader, tokenizer)
    totals = accelerator.reduce(torch.tensor([loss_sum, tokens], dtype=torch.float64, device=accelerator.device), "sum")
    results = gather_results(results)  # collective
    row = {"eval_loss": (totals[0] / totals[1]).item()}
    if accelerator.is_main_process:  # metric modules run on the main process only
        scores = scorer([h for _, h, _ in results], [r for _, _, r in results])
        row.update(eval_wer=scores["wer"], eval_cer=scores["cer"])
    return row


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
    # LibriSpeech layout: checked once per output_dir (first process to arrive; the others wait):
    # missing, corrupt, empty, too short/long, multi-channel audio, duplicate ids, malformed lines.
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=None, on_bad_data=cfg.on_bad_data)  # text: normalize_text decides

    def checked(root, split):
        return prepare_manifest(out, split, root, policy, split, is_main_process=accelerator.is_main_process)

    train_set = labelled_subset(read_split(data_dir, cfg.train_split, checked), cfg.train_fraction)
    valid_set = read_split(data_dir, cfg.valid_split, checked)
    logger.info(f"{len(train_set)} training utterances ({sum(train_set['duration']) / 3600:.2f} h), "
                f"{len(valid_set)} validation, {world} process(es)")

    # ---- tokenizer: built once into <output_dir>/tokenizer/ by one process, the others wait ----
    tok_info = {"token_type": cfg.token_type, "bpe_vocab_size": cfg.bpe_vocab_size, "train_split": cfg.train_split,
                "train_fraction": cfg.train_fraction, "data_dir": cfg.data_dir}
    tok_dir = prepare_once(out / "tokenizer", lambda tmp: build_tokenizer(
        cfg.token_type, list(train_set["text"]), tmp, cfg.bpe_vocab_size), info=tok_info)
    built = json.loads((tok_dir / ".complete").read_text())
    if any(built.get(k) != v for k, v in tok_info.items()):
        raise RuntimeError(f"{tok_dir} was built with other settings ({built}); use a new --output_dir")
    tokenizer = load_tokenizer(tok_dir)
    logger.info(f"tokens: {cfg.token_type}, {tokenizer.vocab_size} CTC classes (blank included)")

    train_ds = SpeechDataset(train_set, cfg, tokenizer, cfg.speed_perturb)
    train_loader, train_sampler, train_collator = make_loader(train_ds, train_set["duration"], cfg, world, True)
    valid_loader, _, _ = make_loader(
        SpeechDataset(valid_set, cfg, tokenizer), valid_set["duration"], cfg, world, False)

    # ---- model -----------------------------------------------------------------------------
    enc_cfg = encoder_config(
        input_dim=cfg.n_mels * cfg.stack_frames, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, ffn_dim=cfg.ffn_dim, conv_kernel=cfg.conv_kernel, dropout=cfg.dropout)
    model = ConformerCTC(enc_cfg, n_mels=cfg.n_mels, stack_frames=cfg.stack_frames, vocab_size=tokenizer.vocab_size)
    stats_loaded = load_best_rq(model, cfg.init_from, cfg_dict) if cfg.init_from else False  # every rank
    logger.info(f"encoder: {sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters"
                + (f", initialized from {cfg.init_from}" if cfg.init_from else ", from scratch"))

    # ---- optimizer and schedule (sized in optimizer steps) -----------------------------------
    # The head first, so that logged "lr" is the head's; the encoder at encoder_lr_scale × that.
    groups = []
    for part, lr in ((model.head, cfg.learning_rate), (model.encoder, cfg.learning_rate * cfg.encoder_lr_scale)):
        groups.append({"params": [p for p in part.parameters() if p.ndim >= 2], "weight_decay": cfg.weight_decay, "lr": lr})
        groups.append({"params": [p for p in part.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": lr})
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(cfg.warmup_steps))
    encoder_params = list(model.encoder.parameters())

    # The scheduler is not prepared: we step it once per optimizer step ourselves (accelerate #1382).
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)
    state = TrainState(world_size=world, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                       config_hash=config_hash(cfg_dict, ignore=RESUME_SAFE_KEYS), config=cfg_dict)
    accelerator.register_for_checkpointing(state, scheduler)

    # ---- resume, or start: global feature statistics (BEST-RQ's, or computed once and broadcast) --
    ckpt = resume_from_checkpoint(accelerator, out, state)
    if ckpt is not None:
        logger.info(f"resumed from {ckpt}: step {state.step}, epoch {state.epoch}, "
                    f"batch {state.batches_in_epoch} of the epoch")
    elif not stats_loaded:
        def compute():  # an evenly spaced subset: the manifest is sorted by speaker
            stride = max(1, len(train_set) // cfg.stats_utterances)
            logmel = LogMel(cfg.sample_rate, cfg.n_mels)
            return feature_stats([logmel(load_wav(train_set[i], cfg.sample_rate))
                                  for i in range(0, len(train_set), stride)])
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
    scorer = Scorer()

    # ---- training loop ----------------------------------------------------------------------
    accum = cfg.gradient_accumulation_steps
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    window_loss = 0.0
    while state.step < cfg.max_steps:
        # Set the epoch on every object that has one: accelerate does not reach our sampler in
        # DDP, and its own epoch counter is not checkpointed (ACCELERATE_NOTES).
        train_sampler.set_epoch(state.epoch)
        train_loader.set_epoch(state.epoch)
        train_collator.epoch = state.epoch
        train_ds.epoch = state.epoch
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
                log_probs, out_lens = model(batch["feats"], batch["feat_lens"], batch["time_mask"], batch["freq_mask"])
                loss = ctc_loss(log_probs, out_lens, batch["targets"], batch["target_lens"])
                accelerator.backward(loss / window_len)  # the mean over the window's batches
            window_loss += loss.detach() / window_len
            state.batches_in_epoch += 1
            if not sync:
                continue

            # Frozen encoder: every parameter still gets its (DDP-reduced) gradient, so the DDP
            # reducer sees the same graph every step; we drop the encoder's before the update,
            # and AdamW skips parameters without a gradient (no step, no decay, no moments).
            if state.step < cfg.freeze_encoder_steps:
                for p in encoder_params:
                    p.grad = None
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
                row = evaluate(model, valid_loader, accelerator, tokenizer, scorer)  # collective
                logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
            if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
                # Collective (all ranks): mean over processes.
                loss_mean = accelerator.reduce(window_loss.float(), "mean")
                row = {"step": state.step, "epoch": state.epoch, "loss": loss_mean.item(),
                       "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm.item(),
                       "skipped_updates": state.skipped_updates, **row}
                metrics.log(row)  # one line per logged step, main process only
                accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
                bar.set_postfix(loss=f"{row['loss']:.3f}")
            window_loss = 0.0
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

    # ---- export: everything needed to transcribe ------------------------------------------
    accelerator.wait_for_everyone()
    final = out / "final"
    accelerator.save_model(model, final)  # model.safetensors (encoder, head, feature stats), rank 0
    if accelerator.is_main_process:
        save_config(cfg, final / "config.yaml")
        shutil.copytree(tok_dir, final / "tokenizer", dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete"))
        logger.info(f"final model in {final}")
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
