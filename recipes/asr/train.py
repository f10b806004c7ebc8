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
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr --split test

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see the top README "Resume").
Outputs: <output_dir>/final/ (a transformers Wav2Vec2BertForCTC + feature extractor + tokenizer, and our
config.yaml, tokenizer/), <output_dir>/metrics.jsonl.

Adapting it: the data (data.py), the model and its loss (model.py), freezing, what is logged and
evaluated are yours to change. The loop's calls into common/loop.py carry the exact-resume and DDP
guarantees (docs/resume.md); they check their own order (a bypassed or misplaced one stops the run
with a ContractError saying which), and tests/recipes/test_contract.py checks that every recipe
calls them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from common.config import parse_config


@dataclass
class Config:
    """Conformer-CTC ASR. Every field can be set in the YAML (--config) or as --key value."""

    # --- data ---
    data_dir: str | None = None  # LibriSpeech-layout root or datasets.save_to_disk folder (manifest.py); None = built-in corpus
    train_split: str = "train"  # subfolder(s) of data_dir, comma-separated (train-clean-100,train-clean-360)
    valid_split: str = "validation"
    builtin_corpus: Literal["default", "tiny"] = "default"  # built-in corpus profile when data_dir is None
    data_cache_dir: str | None = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    train_fraction: float = 1.0  # labelled subset: the round(fraction·N) training utterances whose ids hash lowest
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
    # --- output tokens ---
    token_type: Literal["char", "bpe"] = "char"  # char: a-z, ', space; bpe: SentencePiece trained on the training transcripts
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
    dropout: float = 0.1  # residual branches and input projection
    attention_dropout: float = 0.1  # on attention probabilities
    activation_dropout: float = 0.1  # on feed-forward activations
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
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None  # None: the accelerate profile's; set: overrides it
    num_threads: int = 0  # torch threads per process; 0 = auto (resume: the checkpoint's; else cores ÷ processes)
    deterministic: bool = False  # deterministic kernels: bit-exact resume on GPUs too (slower)
    ddp_timeout: float = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- logging / checkpoints ---
    overwrite_output_dir: bool = False  # allow an --output_dir that holds files but is not a run of this recipe
    output_dir: str = "outputs/asr"
    logging_steps: int = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: int = 250  # optimizer steps between validation passes (loss, greedy WER/CER; 0 = never)
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
from common.encoder import encoder_config_from, load_pretrained_encoder  # noqa: E402
from common.faults import Preemption, RunError, run_main  # noqa: E402
from common.features import LogMel, feature_stats, set_feature_stats  # noqa: E402
from common.logs import MetricsLog, Throughput, get_logger, progress_bar, start_trackers  # noqa: E402
from common.loop import (end_step, inverse_sqrt_schedule, no_sync_unless, optimizer_update,  # noqa: E402
                         save_or_preempt, train_batches)
from common.manifest import DataPolicy, manifest_summary, prepare_manifest  # noqa: E402
from common.prepare import prepare_once  # noqa: E402
from common.rundir import claim_output_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from ctc_decode import evaluate  # noqa: E402
from data import SpecAugmentCollator, SpeechDataset, labelled_subset, load_wav, read_split  # noqa: E402
from model import ConformerCTC, ctc_loss, export_hf  # noqa: E402
from scoring import Scorer  # noqa: E402
from text import build_tokenizer, load_tokenizer  # noqa: E402

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
    if cfg.deterministic and accelerator.device.type == "cuda":
        raise RunError("--deterministic on a GPU: CUDA's CTC loss backward has no deterministic implementation, "
                       "so this recipe cannot be bit-exact there; drop --deterministic (resume stays exact in "
                       "position and state)")
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
    # LibriSpeech-layout data is checked once per output_dir (--data_check: missing, corrupt, empty, too
    # short/long, multi-channel audio, duplicate ids, malformed lines).
    data_dir = resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "librispeech")
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=None, on_bad_data=cfg.on_bad_data, data_check=cfg.data_check)  # text: normalize_text decides

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
    train_collator = SpecAugmentCollator(cfg, augment=True)  # the training set only is augmented
    batching = dict(max_batch_seconds=cfg.max_batch_seconds, num_buckets=cfg.num_buckets, seed=cfg.seed,
                    num_workers=num_workers, pin_memory=accelerator.device.type == "cuda")
    train_loader, train_sampler = make_loader(
        keep_in_memory(train_ds, cfg.memory_cache_mb, num_workers, "training"),  # per (utterance, speed factor)
        train_set["duration"], train_collator, shuffle=True, multiple_of=global_batch, **batching)
    valid_ds = keep_in_memory(SpeechDataset(valid_set, cfg, tokenizer), cfg.memory_cache_mb, num_workers, "validation")
    valid_loader, _ = make_loader(valid_ds, valid_set["duration"], SpecAugmentCollator(cfg, augment=False),
                                  shuffle=False, multiple_of=world, **batching)

    # ---- model, optimizer, schedule (sized in optimizer steps) -------------------------------
    model = ConformerCTC(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                         vocab_size=tokenizer.vocab_size)
    stats_loaded = load_pretrained_encoder(model, cfg.init_from, cfg_dict) if cfg.init_from else False  # every rank
    logger.info(f"encoder: {sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters"
                + (f", initialized from {cfg.init_from}" if cfg.init_from else ", from scratch"))
    # The head first, so that logged "lr" is the head's; the encoder at encoder_lr_scale × that.
    groups = []
    for part, lr in ((model.head, cfg.learning_rate), (model.encoder, cfg.learning_rate * cfg.encoder_lr_scale)):
        groups.append({"params": [p for p in part.parameters() if p.ndim >= 2], "weight_decay": cfg.weight_decay, "lr": lr})
        groups.append({"params": [p for p in part.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": lr})
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(cfg.warmup_steps))
    encoder_params = list(model.encoder.parameters())
    # The scheduler is not prepared: it steps once per optimizer step in end_step (accelerate #1382).
    check_fsdp_wrap(accelerator, model)  # FSDP: the profile's shard unit must exist in this model
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)

    # ---- resume, or start: global feature statistics (BEST-RQ's, or computed once and broadcast) --
    parts = dict(models=model, optimizers=optimizer, schedulers=scheduler)  # what a checkpoint holds
    state = TrainState.for_run(cfg_dict, world, accumulation, data=manifest_summary(train_set))  # resume refuses other data
    if resume_from_checkpoint(accelerator, ckpt, state, **parts) is None and not stats_loaded:
        stride = max(1, len(train_set) // cfg.stats_utterances)  # evenly spaced: the manifest is sorted by speaker
        logmel = LogMel(cfg.sample_rate, cfg.n_mels)
        set_feature_stats(accelerator, model, lambda: feature_stats(
            [logmel(load_wav(train_set[i], cfg.sample_rate)) for i in range(0, len(train_set), stride)]))
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
    metrics = MetricsLog(accelerator, out / "metrics.jsonl", resume_step=state.step)
    start_trackers(accelerator, cfg_dict, cfg.report_to, resume_step=state.step)
    scorer = Scorer()

    # ---- training loop ----------------------------------------------------------------------
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    throughput = Throughput(accelerator, dict(zip(train_set["id"], train_set["duration"])))  # audio s/s
    window_loss = torch.zeros((), device=accelerator.device)  # mean CTC loss over the accumulation window
    for batch, micro in train_batches(  # resumes mid-epoch, reseeds dropout from the position
            accelerator, train_loader, state, max_steps=cfg.max_steps, accumulation=accumulation,
            seed=cfg.seed, epoch_objects=(train_sampler, train_collator, train_ds),
            ids_log=out / f"batch_ids.rank{accelerator.process_index}.jsonl" if cfg.dump_batch_ids else None):
        with no_sync_unless(accelerator, model, micro.sync):
            log_probs, out_lens = model(batch["feats"], batch["feat_lens"], batch["time_mask"], batch["freq_mask"])
            loss = ctc_loss(log_probs, out_lens, batch["targets"], batch["target_lens"])
            accelerator.backward(loss / micro.window_len)  # the mean over the window's batches
        window_loss += loss.detach() / micro.window_len
        throughput.add(batch["ids"])
        if not micro.sync:
            continue
        # Frozen encoder: every parameter still gets its (DDP-reduced) gradient, so the DDP reducer
        # sees the same graph every step; we drop the encoder's before the update, and AdamW skips
        # parameters without a gradient (no step, no decay, no moments).
        if state.step < cfg.freeze_encoder_steps:
            for p in encoder_params:
                p.grad = None
        grad_norm = optimizer_update(accelerator, model, optimizer, state, max_grad_norm=cfg.max_grad_norm,
                                     max_nonfinite_updates=cfg.max_nonfinite_updates)
        end_step(state, scheduler)
        bar.update(1)

        row = {}
        if cfg.eval_steps and state.step % cfg.eval_steps == 0:
            row, decoded = evaluate(model, valid_loader, accelerator, tokenizer, scorer)  # collective
            logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
            if accelerator.is_main_process and cfg.report_to == "tensorboard":  # a few hypotheses beside references
                accelerator.get_tracker("tensorboard", unwrap=True).add_text("eval/decoded", "\n\n".join(
                    f"`{i}`  \nref: {ref}  \nhyp: {hyp}" for i, hyp, ref in decoded[:4]), state.step)
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            loss_mean = accelerator.reduce(window_loss, "mean").item()  # collective: mean over processes
            row = {"step": state.step, "epoch": state.epoch, "loss": loss_mean, "lr": scheduler.get_last_lr()[0],
                   "grad_norm": grad_norm.item(), "skipped_updates": state.skipped_updates,
                   "audio_s_per_s": throughput.rate(), **row}  # rate(): collective
            metrics.log(row)  # one line per logged step, main process only
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
            bar.set_postfix(audio_s_per_s=f"{row['audio_s_per_s']:.0f}", loss=f"{row['loss']:.3f}")
        window_loss.zero_()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: everything needed to transcribe; final/ appears complete or not at all ------
    def write_extras(folder: Path) -> None:  # main process: final/ as a transformers model, plus ours
        save_config(cfg, folder / "config.yaml")
        shutil.copytree(tok_dir, folder / "tokenizer", ignore=shutil.ignore_patterns(".complete"))
        export_hf(folder, load_file(folder / "model.safetensors"), cfg, tokenizer)

    export_final(accelerator, model, out, write_extras)  # collective
    accelerator.end_training()

if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
