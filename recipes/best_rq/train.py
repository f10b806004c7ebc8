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
Outputs: <output_dir>/final/{model.safetensors, config.yaml, encoder/} (encoder/: a transformers folder,
AutoModel + AutoFeatureExtractor), <output_dir>/metrics.jsonl.

Adapting it: the data (data.py), the model and its loss (model.py), what is logged and evaluated are
yours to change. The loop's calls into common/loop.py carry the exact-resume and DDP guarantees
(docs/resume.md); they check their own order (a bypassed or misplaced one stops the run with a
ContractError saying which), and tests/recipes/test_contract.py checks that every recipe calls them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.config import parse_config


@dataclass
class Config:
    """BEST-RQ pre-training. Every field can be set in the YAML (--config) or as --key value."""

    # --- data ---
    data_dir: str | None = None  # LibriSpeech-layout root; None = the built-in espeak-ng corpus
    train_split: str = "train"  # subfolder(s) of data_dir, comma-separated (train-clean-100,train-other-500)
    valid_split: str = "validation"
    builtin_corpus: Literal["default", "tiny"] = "default"  # built-in corpus profile when data_dir is None
    data_cache_dir: str | None = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    sample_rate: int = 16000  # Hz
    wrong_sample_rate: Literal["resample", "refuse"] = "resample"  # audio at another rate: resampled on load, or refused
    min_seconds: float = 0.5  # shorter utterances are refused by the data check
    max_seconds: float = 30.0  # longer utterances are refused by the data check
    on_bad_data: Literal["error", "skip"] = "error"  # unusable entries: stop with a report, or drop them and log counts
    data_check: Literal["header", "full"] = "header"  # audio check: "header" = header + the last block of each file decoded; "full" = every sample (also finds silent/NaN audio, mid-file damage; slower)
    n_mels: int = 80  # log-mel bins, 25 ms window, 10 ms hop
    max_batch_seconds: float = 60.0  # padded seconds of audio per batch, per process
    num_buckets: int = 10  # duration buckets for batching
    num_workers: int | None = None  # DataLoader workers per process; None = auto (CPU: 0, GPU: up to 4); results do not depend on it
    memory_cache_mb: int = 512  # per process and set: features kept in RAM after their first read, so later epochs skip decoding (only without data workers, the CPU default; 0 = off)
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
    dropout: float = 0.1  # residual branches and input projection
    attention_dropout: float = 0.0  # on attention probabilities (0 here and below: 1.26× the steps/s on CPU, eval loss within 0.6 % of 0.1's over 600 steps; benchmarks/README.md)
    activation_dropout: float = 0.0  # on feed-forward activations
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
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None  # None: the accelerate profile's; set: overrides it
    num_threads: int = 0  # torch threads per process; 0 = auto (resume: the checkpoint's; else cores ÷ processes)
    deterministic: bool = False  # deterministic kernels: bit-exact resume on GPUs too (slower)
    ddp_timeout: float = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- logging / checkpoints ---
    overwrite_output_dir: bool = False  # allow an --output_dir that holds files but is not a run of this recipe
    output_dir: str = "outputs/best_rq"
    logging_steps: int = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: int = 250  # optimizer steps between validation passes (0 = never)
    save_steps: int = 250  # optimizer steps between checkpoints
    save_total_limit: int = 2  # complete checkpoints kept (oldest pruned after a new one is complete)
    report_to: Literal["tensorboard", "none"] = "tensorboard"  # where metrics go besides metrics.jsonl
    dump_batch_ids: bool = False  # write each rank's utterance ids per batch (audits DDP sharding)


if __name__ == "__main__":  # --help and config mistakes are answered before the slow imports below
    CONFIG = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from common.checkpoint import (TrainState, checkpoint_threads, choose_checkpoint, export_final,  # noqa: E402
                               global_batch_plan, resume_from_checkpoint)
from common.config import config_to_dict, save_config  # noqa: E402
from common.corpus import resolve_data_dir  # noqa: E402
from common.data import auto_workers, keep_in_memory, make_loader  # noqa: E402
from common.distributed import (build_accelerator, check_fsdp_wrap, describe_run, seed_everything,  # noqa: E402
                                set_threads)
from common.encoder import encoder_config_from  # noqa: E402
from common.faults import Preemption, run_main  # noqa: E402
from common.features import feature_stats, set_feature_stats  # noqa: E402
from common.hf_export import save_feature_extractor  # noqa: E402
from common.logs import MetricsLog, Throughput, get_logger, progress_bar, start_trackers  # noqa: E402
from common.loop import (end_step, inverse_sqrt_schedule, no_sync_unless, optimizer_update,  # noqa: E402
                         save_or_preempt, train_batches)
from common.manifest import DataPolicy, manifest_summary, prepare_manifest  # noqa: E402
from common.rundir import claim_output_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from data import FeatureDataset, MaskingCollator  # noqa: E402
from model import BestRQ, evaluate  # noqa: E402

logger = get_logger(__name__)


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
    # the data check runs once per output_dir (missing, corrupt, empty, too short/long,
    # multi-channel, wrong-rate audio, duplicate ids, malformed lines).
    data_dir = resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "librispeech")
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=None, on_bad_data=cfg.on_bad_data, data_check=cfg.data_check)  # no transcripts
    is_main = accelerator.is_main_process
    train_set = prepare_manifest(out, "train", data_dir, policy, cfg.train_split, is_main_process=is_main)
    valid_set = prepare_manifest(out, "valid", data_dir, policy, cfg.valid_split, is_main_process=is_main)
    logger.info(f"{len(train_set)} training utterances ({sum(train_set['duration']) / 3600:.2f} h), "
                f"{len(valid_set)} validation, {world} process(es)")
    train_ds = keep_in_memory(FeatureDataset(train_set, cfg.sample_rate, cfg.n_mels), cfg.memory_cache_mb,
                              num_workers, "training")
    collator = MaskingCollator(cfg)
    batching = dict(max_batch_seconds=cfg.max_batch_seconds, num_buckets=cfg.num_buckets, seed=cfg.seed,
                    num_workers=num_workers, pin_memory=accelerator.device.type == "cuda")
    train_loader, train_sampler = make_loader(train_ds, train_set["duration"], collator, shuffle=True,
                                              multiple_of=global_batch, **batching)
    valid_ds = keep_in_memory(FeatureDataset(valid_set, cfg.sample_rate, cfg.n_mels), cfg.memory_cache_mb,
                              num_workers, "validation")
    valid_loader, _ = make_loader(valid_ds, valid_set["duration"], collator, shuffle=False, multiple_of=world,
                                  **batching)

    # ---- model, optimizer, schedule (sized in optimizer steps) -------------------------------
    model = BestRQ(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                   codebook_size=cfg.codebook_size, code_dim=cfg.code_dim, quantizer_seed=cfg.quantizer_seed)
    logger.info(f"encoder: {sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters")
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
        stride = max(1, len(train_ds) // cfg.stats_utterances)  # evenly spaced: the manifest is sorted by speaker
        set_feature_stats(accelerator, model, lambda: feature_stats(
            [train_ds[i][1] for i in range(0, len(train_ds), stride)]))
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
    metrics = MetricsLog(accelerator, out / "metrics.jsonl", resume_step=state.step)
    start_trackers(accelerator, cfg_dict, cfg.report_to, resume_step=state.step)

    # ---- training loop ----------------------------------------------------------------------
    logger.info(f"chance level: ln({cfg.codebook_size}) = {math.log(cfg.codebook_size):.3f}")
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    throughput = Throughput(accelerator, dict(zip(train_set["id"], train_set["duration"])))  # audio s/s
    window = torch.zeros(2, device=accelerator.device)  # loss, accuracy: means over the accumulation window
    for batch, micro in train_batches(  # resumes mid-epoch, reseeds dropout from the position
            accelerator, train_loader, state, max_steps=cfg.max_steps, accumulation=accumulation,
            seed=cfg.seed, epoch_objects=(train_sampler, collator),
            ids_log=out / f"batch_ids.rank{accelerator.process_index}.jsonl" if cfg.dump_batch_ids else None):
        with no_sync_unless(accelerator, model, micro.sync):
            loss, acc, _, _ = model(batch["feats"], batch["feat_lens"], batch["mask"], batch["noise"])
            accelerator.backward(loss / micro.window_len)  # the mean over the window's batches
        window += torch.stack([loss.detach(), acc.detach()]) / micro.window_len
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
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            loss_acc = accelerator.reduce(window, "mean").tolist()  # collective: mean over processes
            row = {"step": state.step, "epoch": state.epoch, "loss": loss_acc[0], "acc": loss_acc[1],
                   "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm.item(),
                   "skipped_updates": state.skipped_updates,
                   "audio_s_per_s": throughput.rate(), **row}  # rate(): collective
            metrics.log(row)  # one line per logged step, main process only
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
            bar.set_postfix(audio_s_per_s=f"{row['audio_s_per_s']:.0f}", loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}")
        window.zero_()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: final/ appears complete or not at all -------------------------------------
    def write_extras(folder: Path) -> None:  # main process, beside model.safetensors (quantizer, stats)
        save_config(cfg, folder / "config.yaml")
        weights = load_file(folder / "model.safetensors")  # the full weights, also when training was sharded
        # encoder/: a transformers folder (AutoModel + AutoFeatureExtractor with our statistics)
        accelerator.unwrap_model(model).encoder.save_pretrained(
            folder / "encoder", state_dict={k[len("encoder."):]: v for k, v in weights.items() if k.startswith("encoder.")})
        save_feature_extractor(folder / "encoder", n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                               sample_rate=cfg.sample_rate, mean=weights["feat_mean"], std=weights["feat_std"])

    export_final(accelerator, model, out, write_extras)  # collective
    accelerator.end_training()

if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
