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
    python recipes/tts/score.py --checkpoint outputs/tts --split test

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see README "Resume").
Outputs: <output_dir>/final/{model.safetensors, config.yaml, symbols.json}, <output_dir>/metrics.jsonl.

Adapting it: the data (data.py), the model (model.py), the losses and their weights, what is logged
and evaluated are yours to change. The loop's calls into common/loop.py carry the exact-resume and
DDP guarantees (docs/resume.md); they check their own order (a bypassed or misplaced one stops the
run with a ContractError saying which), and tests/recipes/test_contract.py checks that every recipe
calls them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.config import parse_config

LOSSES = ("mel_loss", "dur_loss", "align_loss", "bin_loss")


@dataclass
class Config:
    """TTS training. Every field can be set in the YAML (--config) or as --key value."""

    # --- data ---
    data_dir: str | None = None  # LJSpeech-layout root (wavs/ + metadata.csv); None = built-in corpus
    builtin_corpus: Literal["default", "tiny"] = "default"  # built-in corpus profile when data_dir is None
    data_cache_dir: str | None = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    num_valid: int = 20  # utterances for validation: the num_valid ids just before the test ids
    num_test: int = 20  # held-out utterances for score.py: the last num_test ids (sorted)
    symbols: str = " abcdefghijklmnopqrstuvwxyz'.,;:?!-\"()"  # characters; text is lowercased first
    sample_rate: int = 22050  # Hz
    wrong_sample_rate: Literal["resample", "refuse"] = "resample"  # audio at another rate: resampled on load, or refused
    min_seconds: float = 0.5  # shorter utterances are refused by the data check
    max_seconds: float = 15.0  # longer utterances are refused by the data check
    on_bad_data: Literal["error", "skip"] = "error"  # unusable entries: stop with a report, or drop them and log counts
    data_check: Literal["header", "full"] = "header"  # audio check: "header" = header + the last block of each file decoded; "full" = every sample (also finds silent/NaN audio, mid-file damage; slower)
    n_mels: int = 80  # log-mel bins (HTK scale, 0 Hz to Nyquist)
    win_length: int = 1024  # samples (46 ms); n_fft is the next power of two ≥ it
    hop_length: int = 256  # samples (11.6 ms per frame)
    max_batch_seconds: float = 40.0  # padded seconds of audio per batch, per process
    num_buckets: int = 10  # duration buckets for batching
    num_workers: int | None = None  # DataLoader workers per process; None = auto (CPU: 0, GPU: up to 4); results do not depend on it
    memory_cache_mb: int = 512  # per process and set: features kept in RAM after their first read, so later epochs skip decoding (only without data workers, the CPU default; 0 = off)
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
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None  # None: the accelerate profile's; set: overrides it
    num_threads: int = 0  # torch threads per process; 0 = auto (resume: the checkpoint's; else cores ÷ processes)
    deterministic: bool = False  # deterministic kernels: bit-exact resume on GPUs too (slower)
    ddp_timeout: float = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- logging / checkpoints ---
    overwrite_output_dir: bool = False  # allow an --output_dir that holds files but is not a run of this recipe
    output_dir: str = "outputs/tts"
    logging_steps: int = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: int = 250  # optimizer steps between validation passes (0 = never)
    save_steps: int = 250  # optimizer steps between checkpoints
    save_total_limit: int = 2  # complete checkpoints kept (oldest pruned after a new one is complete)
    report_to: Literal["tensorboard", "none"] = "tensorboard"  # where metrics go besides metrics.jsonl
    num_samples: int = 2  # fixed validation sentences synthesized into TensorBoard at each validation
    griffin_lim_iters: int = 32  # Griffin-Lim iterations for those samples
    dump_batch_ids: bool = False  # write each rank's utterance ids per batch (audits DDP sharding)


if __name__ == "__main__":  # --help and config mistakes are answered before the slow imports below
    CONFIG = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))

import torch  # noqa: E402

from common.checkpoint import (TrainState, checkpoint_threads, choose_checkpoint, export_final,  # noqa: E402
                               global_batch_plan, resume_from_checkpoint)
from common.config import config_to_dict, save_config  # noqa: E402
from common.corpus import resolve_data_dir  # noqa: E402
from common.data import auto_workers, keep_in_memory, load_audio, make_loader  # noqa: E402
from common.distributed import (build_accelerator, check_fsdp_wrap, describe_run, seed_everything,  # noqa: E402
                                set_threads)
from common.faults import Preemption, run_main  # noqa: E402
from common.features import feature_stats, set_feature_stats  # noqa: E402
from common.logs import MetricsLog, Throughput, get_logger, progress_bar, start_trackers  # noqa: E402
from common.loop import (end_step, inverse_sqrt_schedule, no_sync_unless, optimizer_update,  # noqa: E402
                         save_or_preempt, train_batches)
from common.manifest import DataPolicy, manifest_summary, prepare_manifest  # noqa: E402
from common.rundir import claim_output_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from audio import GriffinLim, mel_frontend, stack_images, to_image  # noqa: E402
from data import Collator, TTSDataset, split_manifest  # noqa: E402
from model import Symbols, build_model  # noqa: E402

logger = get_logger(__name__)


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


def main(cfg: Config) -> None:
    out = Path(cfg.output_dir)
    accelerator = build_accelerator(
        mixed_precision=cfg.mixed_precision, project_dir=str(out),
        log_with=None if cfg.report_to == "none" else cfg.report_to, timeout_s=cfg.ddp_timeout,
        deterministic=cfg.deterministic,
    )
    world = accelerator.num_processes
    # One run per output_dir, and only a run of this recipe (a user's own folder is refused).
    claim_output_dir(accelerator, out, Path(__file__).parent.name, cfg.overwrite_output_dir)
    preemption = Preemption(accelerator)  # a signal now: clean exit (75); in the loop: save, then exit 75
    seed_everything(cfg.seed)  # model init: identical on every rank
    cfg = dataclasses.replace(cfg, mixed_precision=accelerator.mixed_precision)  # what runs: profile's or flag's
    cfg_dict = config_to_dict(cfg)
    symbols = Symbols(cfg.symbols)

    # ---- where to resume (chosen first: the checkpoint's global batch sizes the data batches) --
    ckpt = choose_checkpoint(accelerator, out)  # the newest intact checkpoint, or None (collective)
    # Micro-batches per optimizer step are fixed at the first launch; a re-launch on another number
    # of processes changes the accumulation to keep them (or is refused, naming what works).
    accumulation, global_batch = global_batch_plan(ckpt, world, cfg.gradient_accumulation_steps,
                                                   accelerator.is_main_process)
    _, threads_why = set_threads(cfg.num_threads, checkpoint_threads(ckpt))  # every core busy; a resume keeps its count
    num_workers = auto_workers(cfg.num_workers, cuda=accelerator.device.type == "cuda")
    logger.info(describe_run(accelerator, cfg.max_batch_seconds, accumulation, threads_why, num_workers))

    # ---- data ------------------------------------------------------------------------------
    # The built-in corpus is generated once per cache folder (one process builds, the others wait);
    # the data check runs once per output_dir: bad audio, and characters outside the symbol table.
    data_dir = resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "ljspeech")
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=cfg.symbols + cfg.symbols.upper(), on_bad_data=cfg.on_bad_data,
                        data_check=cfg.data_check)
    manifest = prepare_manifest(out, "all", data_dir, policy, None, is_main_process=accelerator.is_main_process)
    splits = split_manifest(manifest, cfg.num_valid, cfg.num_test)
    train_set, valid_set = splits["train"], splits["validation"]
    logger.info(f"{len(train_set)} training utterances ({sum(train_set['duration']) / 3600:.2f} h), "
                f"{len(valid_set)} validation, {len(splits['test'])} test, {world} process(es)")
    train_ds = keep_in_memory(TTSDataset(train_set, cfg), cfg.memory_cache_mb, num_workers, "training")
    valid_ds = keep_in_memory(TTSDataset(valid_set, cfg), cfg.memory_cache_mb, num_workers, "validation")
    batching = dict(max_batch_seconds=cfg.max_batch_seconds, num_buckets=cfg.num_buckets, seed=cfg.seed,
                    num_workers=num_workers, pin_memory=accelerator.device.type == "cuda")
    train_loader, train_sampler = make_loader(train_ds, train_set["duration"], Collator(cfg), shuffle=True,
                                              multiple_of=global_batch, **batching)
    valid_loader, _ = make_loader(valid_ds, valid_set["duration"], Collator(cfg), shuffle=False, multiple_of=world,
                                  **batching)

    # ---- model, optimizer, schedule (sized in optimizer steps) -------------------------------
    model = build_model(cfg)
    logger.info(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
                f"{len(symbols) - 1} symbols")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(cfg.warmup_steps))
    # The scheduler is not prepared: it steps once per optimizer step in end_step (accelerate #1382).
    check_fsdp_wrap(accelerator, model)  # FSDP: the profile's shard unit must exist in this model
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)

    # ---- resume, or start: global feature statistics (computed once, broadcast, checkpointed) --
    parts = dict(models=model, optimizers=optimizer, schedulers=scheduler)  # what a checkpoint holds
    state = TrainState.for_run(cfg_dict, world, accumulation, data=manifest_summary(train_set))  # resume refuses other data
    if resume_from_checkpoint(accelerator, ckpt, state, **parts) is None:
        stride = max(1, len(train_ds) // cfg.stats_utterances)  # evenly spaced over the sorted ids
        set_feature_stats(accelerator, model, lambda: feature_stats(
            [train_ds[i][2] for i in range(0, len(train_ds), stride)]))
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
    metrics = MetricsLog(accelerator, out / "metrics.jsonl", resume_step=state.step)
    writer = vocoder = None
    start_trackers(accelerator, cfg_dict, cfg.report_to, resume_step=state.step)
    if accelerator.is_main_process and "tensorboard" in cfg.report_to:
        writer = accelerator.get_tracker("tensorboard", unwrap=True)  # the SummaryWriter
        vocoder = GriffinLim(mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length),
                             n_iter=cfg.griffin_lim_iters)

    # ---- training loop ----------------------------------------------------------------------
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    throughput = Throughput(accelerator, dict(zip(train_set["id"], train_set["duration"])))  # audio s/s
    window = torch.zeros(len(LOSSES) + 1, device=accelerator.device)  # loss, mel, dur, align, bin: window means
    for batch, micro in train_batches(  # resumes mid-epoch, reseeds dropout from the position
            accelerator, train_loader, state, max_steps=cfg.max_steps, accumulation=accumulation,
            seed=cfg.seed, epoch_objects=(train_sampler,),
            ids_log=out / f"batch_ids.rank{accelerator.process_index}.jsonl" if cfg.dump_batch_ids else None):
        binarize = state.step >= cfg.binarization_start_steps  # same on every rank
        with no_sync_unless(accelerator, model, micro.sync):
            out_ = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"],
                         batch["log_prior"], binarize)
            loss = total_loss(out_, cfg, binarize)
            accelerator.backward(loss / micro.window_len)  # the mean over the window's batches
        window += torch.stack([loss.detach()] + [out_[k].detach() for k in LOSSES]) / micro.window_len
        throughput.add(batch["ids"])
        if not micro.sync:
            continue
        grad_norm = optimizer_update(accelerator, model, optimizer, state, max_grad_norm=cfg.max_grad_norm,
                                     max_nonfinite_updates=cfg.max_nonfinite_updates)
        end_step(state, scheduler)
        bar.update(1)

        row = {}
        if cfg.eval_steps and state.step % cfg.eval_steps == 0:
            row = evaluate(model, valid_loader, accelerator)  # collective
            logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
            if writer is not None:  # main process only; no collectives inside
                log_samples(accelerator.unwrap_model(model), valid_ds, cfg, writer, vocoder, state.step)
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            means = accelerator.reduce(window, "mean").tolist()  # collective: mean over processes
            row = {"step": state.step, "epoch": state.epoch, "loss": means[0],
                   **{k: means[j + 1] for j, k in enumerate(LOSSES)}, "lr": scheduler.get_last_lr()[0],
                   "grad_norm": grad_norm.item(), "skipped_updates": state.skipped_updates,
                   "audio_s_per_s": throughput.rate(), **row}  # rate(): collective
            metrics.log(row)  # one line per logged step, main process only
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
            bar.set_postfix(audio_s_per_s=f"{row['audio_s_per_s']:.0f}", loss=f"{row['loss']:.3f}", mel=f"{row['mel_loss']:.3f}")
        window.zero_()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: final/ appears complete or not at all -------------------------------------
    def write_extras(folder: Path) -> None:  # main process, beside model.safetensors (incl. feature stats)
        save_config(cfg, folder / "config.yaml")
        (folder / "symbols.json").write_text(json.dumps({"symbols": cfg.symbols}) + "\n")

    export_final(accelerator, model, out, write_extras)  # collective
    accelerator.end_training()

if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
