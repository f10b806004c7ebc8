"""Non-autoregressive TTS with a learned aligner (FastSpeech-style + Badlani et al. 2021), with
Hugging Face Accelerate.

    # built-in single-voice espeak-ng corpus (LJSpeech layout), 1 process (CPU or one GPU)
    accelerate launch recipes/tts/train.py
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/tts/train.py
    # the real LJSpeech
    accelerate launch recipes/tts/train.py --data_dir /data/LJSpeech-1.1 --phonemizer_language en-us --num_valid 100 --num_test 500
    # a voice of your own, started from the built-in voice's model (trained first, once per machine: README)
    accelerate launch recipes/tts/train.py --data_dir my_voice --phonemizer_language fr
    # a `datasets` source (train/validation splits), its parquet shards streamed in place
    accelerate launch recipes/tts/train.py --dataset_name data/my_voice_parquet --phonemizer_language en-us \
        --streaming true --per_device_train_batch_size 16
    # then
    python recipes/tts/synthesize.py --checkpoint outputs/tts --text "a radio wrote this clever pencil" --output out.wav
    python recipes/tts/score.py --checkpoint outputs/tts --split test

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see README "Resume").
Outputs: <output_dir>/final/{model.safetensors, config.yaml, symbols.json}, <output_dir>/metrics.jsonl.

Adapting it: the data (data.py), the model (model.py), the losses and their weights, what is logged
and evaluated are yours to change; the seams above `main` (build_data, build_models,
build_optimizers, compute_loss: README.md, "Adapt a recipe") are what the benchmarks and tests build the
recipe with. The loop's calls into common/training/loop.py carry the exact-resume
and DDP guarantees (docs/resume.md); they check their own order (a bypassed or misplaced one stops the
run with a ContractError saying which), and tests/guarantees/test_contract.py checks that every recipe calls them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import DatasetConfig, exit_on_signals_during_start_up, parse_config
from common.config_rules import Count, ExistingPath, ExistingPathOr, Internal, NonNegative, Positive, Range, ResumeSafe

@dataclass
class Config(DatasetConfig):
    """TTS training. Every field can be set in the YAML (--config) or as --key value; the shared
    ones (run, data and a `datasets` source, optimization, logging) and their rules are RunConfig's
    and DatasetConfig's (common/config.py)."""

    # RunConfig's settings with this recipe's defaults
    output_dir: str = "outputs/tts"
    metric_for_best_model: Literal["eval_mel_loss", "eval_dur_loss", "eval_len_loss", "eval_align_loss", "eval_bin_loss"] = "eval_mel_loss"
    data_dir: str | None = None  # LJSpeech-layout root (wavs/ + metadata.csv) or an audiofolder (metadata.csv: file_name,text); None = built-in corpus
    sample_rate: int = 22050  # Hz
    max_seconds: float = 30.0  # longer utterances are refused by the data check (a real voice's prompt set has 20-30 s ones)
    max_batch_seconds: float = 40.0  # padded seconds of audio per batch, per process
    learning_rate: float = 1e-3  # peak LR after warm-up
    warmup_steps: int = 100  # optimizer steps of linear warm-up, then LR ∝ 1/sqrt(step)
    weight_decay: float = 1e-6
    max_grad_norm: float = 1.0
    # --- data ---
    num_valid: Annotated[int, NonNegative] = 20  # utterances for validation: the num_valid ids just before the test ids
    num_test: Annotated[int, NonNegative] = 20  # held-out utterances for score.py: the last num_test ids (sorted)
    FOLDER_ONLY = dict.fromkeys(("num_valid", "num_test"), "--eval_split_name validates and no test utterances are "
                                "held out (score.py takes --data_dir)")
    symbols: str = " abcdefghijklmnopqrstuvwxyz'.,;:?!-\"()"  # the symbol table (text is NFKC-normalized and lowercased first); "auto": every symbol of the training transcripts (frontend.py)
    text_frontend: Literal["characters", "phonemes"] = "characters"  # model input: characters, or espeak-ng IPA phonemes of phonemizer_language (needs --symbols auto)
    phonemizer_language: str | None = None  # espeak-ng voice for --text_frontend phonemes: fr, es, it, ru, en-us, ... (None: en-us for the built-in voice; a voice of your own: read off its transcripts, frontend.guess_language)
    phoneme_punctuation: bool = False  # phonemes: the marks that end a clause as symbols (`,` inside a sentence, `.` at its end), for the pauses there (frontend.py)
    unknown_chars: Literal["error", "drop"] = "error"  # a validation/test symbol outside the table: refuse, or leave it out of that text
    symbols_derived: Annotated[bool, ResumeSafe, Internal] = False  # written by training, not set (refused on the command line, not in --help; a checkpoint from before the field resumes): True when `symbols` came from the training transcripts (no charset check then; score.py repeats it)
    n_mels: Annotated[int, Count] = 80  # log-mel bins (HTK scale, 0 Hz to Nyquist)
    win_length: Annotated[int, Count] = 1024  # samples (46 ms); n_fft is the next power of two ≥ it
    hop_length: Annotated[int, Count] = 256  # samples (11.6 ms per frame)
    # --- model ---
    # A TTS output_dir or final/ to start from (another voice or language): its weights, symbol embeddings
    # matched by symbol (README, "Transfer"). `builtin`: this recipe's run on the built-in corpus (`base_config`,
    # with this run's model, audio and text settings and its `builtin_corpus`), trained once per machine
    # into the corpus cache (common/training/builtin_base.py); for the built-in voice itself: from scratch.
    # `auto`: `builtin` for small training data (below builtin_base.AUTO_MAX_HOURS), from scratch above.
    init_from: Annotated[str | None, ExistingPathOr("builtin", "auto")] = None  # auto: under 10 h of training data, first trains a second model, the built-in base (this recipe on the built-in voice, once per machine, then cached: minutes on a CPU, estimated in the start log), and starts from it; 10 h or more: from scratch. builtin: the base always; none: from scratch; or a TTS run to start from
    base_config: Annotated[str | None, ExistingPath] = None  # the built-in base's YAML (None: this recipe's config.yaml, 750 steps)
    dim: Annotated[int, Count] = 128  # encoder/decoder width
    encoder_layers: Annotated[int, Count] = 2  # FFT blocks over symbols
    decoder_layers: Annotated[int, Count] = 2  # FFT blocks over frames
    num_heads: Annotated[int, Count] = 2
    ffn_dim: Annotated[int, Count] = 512  # conv feed-forward channels
    conv_kernel: Annotated[int, Count] = 3  # feed-forward conv kernel (symbols / frames)
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.1
    duration_channels: Annotated[int, Count] = 128  # duration predictor conv channels
    attention_dim: Annotated[int, Count] = 80  # aligner key/query dimension
    attention_temperature: Annotated[float, Positive] = 0.005  # score = −temperature · squared distance (0.0005 stalls on a real voice: README)
    prior_scaling: Annotated[float, Positive] = 1.0  # ω of the beta-binomial prior (larger = sharper diagonal)
    blank_logprob: Annotated[float, Range(hi=0)] = -1.0  # score (a log-probability) of the CTC blank column in the forward-sum loss
    # --- losses ---
    duration_loss_weight: Annotated[float, NonNegative] = 0.1
    length_loss_weight: Annotated[float, NonNegative] = 0.1  # utterance length (log frames) of the predicted durations; 0 = the per-symbol loss alone (speech ~17 % short on a real voice: README)
    align_loss_weight: Annotated[float, NonNegative] = 1.0  # forward-sum loss
    binarization_loss_weight: Annotated[float, NonNegative] = 1.0
    binarization_start_steps: Annotated[int | None, NonNegative] = None  # optimizer steps before the binarization loss is switched on; None = never (on a real voice it locks in a wrong path: README)
    # --- weight average (common/training/averaging.py) ---
    # > 0: validation, final/ and the tools reading a checkpoint use an exponential moving average of the
    # weights, decay min(ema_decay, (1 + n) / (10 + n)) after n optimizer steps (0 = the trained weights)
    ema_decay: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    # --- logging / checkpoints ---
    num_samples: Annotated[int, NonNegative, ResumeSafe] = 2  # fixed validation sentences synthesized into TensorBoard at each validation
    griffin_lim_iters: Annotated[int, Count, ResumeSafe] = 32  # Griffin-Lim iterations for those samples


# The test model: what tests/ and benchmarks/ add to this recipe's config.yaml to train it in seconds on
# the tiny built-in corpus (a copy keeps its own: docs/adapt.md, "How the tests pick up the copy").
TEST_TINY = ["--dim", "32", "--ffn_dim", "64", "--duration_channels", "32", "--attention_dim", "32", "--num_heads", "2",
             "--num_valid", "2", "--num_test", "2"]

if __name__ == "__main__":  # --help and config mistakes are answered before the slow imports below
    exit_on_signals_during_start_up()  # a Ctrl-C during the imports: one line, not a traceback
    CONFIG = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))

import torch  # noqa: E402

from common.training.averaging import checkpoint_weights, start_average, swapped_in  # noqa: E402
from common.training.builtin_base import (AUTO as INIT_AUTO, KEYWORD as BUILTIN, base_args, builtin_base,  # noqa: E402
                                          start_from_base, uses_builtin_corpus)
from common.training.checkpoint import export_final  # noqa: E402
from common.training.resume import resume_from_checkpoint  # noqa: E402
from common.training.sealing import resolve_checkpoint  # noqa: E402
from common.training.state import TrainState  # noqa: E402
from common.training.early_stopping import start_early_stopping  # noqa: E402
from common.config import config_to_dict, save_config  # noqa: E402
from common.data.loading import load_row_audio  # noqa: E402
from common.training.distributed import check_fsdp_wrap  # noqa: E402
from common.training.faults import RunError, run_main  # noqa: E402
from common.model.features import feature_stats, set_feature_stats  # noqa: E402
from common.model.hf_export import write_code, write_model_card  # noqa: E402
from common.training.logs import Throughput, WindowMeans, get_logger, progress_bar, trackers  # noqa: E402
from common.training.loop import (adamw_scheduled, decay_groups, no_sync_unless,  # noqa: E402
                         optimizer_update, end_step, save_or_preempt, train_batches, validation_due)
from common.training.run import start_logging, start_run  # noqa: E402
from common.data.manifest import split_manifest  # noqa: E402
from common.data.source import RecipeData, Source  # noqa: E402
from tools.corpus import resolve_data_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from audio import GriffinLim, mel_frontend, stack_images, to_image  # noqa: E402
from data import Collator, TTSDataset  # noqa: E402
from frontend import AUTO, Symbols, guess_language  # noqa: E402
from model import LOSSES, build_model, evaluate, transfer_from  # noqa: E402

logger = get_logger(__name__)


# ---- the recipe's seams: main below, the benchmarks and the tests build the recipe through these ---

def exported_code() -> dict[str, Path]:
    """The source files final/ carries (as tts_<name>.py, common.model.hf_export.write_code): the synthesis
    code and the two files of common/ it imports, so that final/ synthesizes without this repository."""
    here, common_dir = Path(__file__).parent, Path(__file__).resolve().parents[2] / "common" / "model"
    return {**{name: here / f"{name}.py" for name in ("model", "audio", "frontend")},
            **{name: common_dir / f"{name}.py" for name in ("vocoding", "speech_frontend")}}


def build_data(cfg: Config, accelerator, out: Path, *, global_batch: int, num_workers: int) -> RecipeData:
    """Symbol ids and log-mels, and their collator, on the source (common/data/source.py): an
    LJSpeech-layout folder split into training/validation/test by id, or --dataset_name (its
    --train_split_name trains, its --eval_split_name validates). `data.tokenizer`: the symbol table the
    items were encoded with (`--symbols auto`: derived from the training transcripts); `data.recorded`:
    it and the --phonemizer_language, as the run records them in its config."""
    language = cfg.phonemizer_language
    if cfg.text_frontend == "phonemes" and language is None and uses_builtin_corpus(cfg):
        language = "en-us"  # the built-in voice speaks English
    fixed_table = cfg.symbols != AUTO and cfg.text_frontend == "characters"  # else known from the training texts only
    source = Source.open(cfg, accelerator, out, global_batch=global_batch, num_workers=num_workers,
                         corpus=lambda: resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "ljspeech"),
                         splits=lambda data_dir, check: split_manifest(check("all", None), cfg.num_valid, cfg.num_test),
                         charset=cfg.symbols + cfg.symbols.upper() if fixed_table else None)  # a folder's data check
    # The symbol table: --symbols, or derived from the training transcripts and recorded in the run's
    # config (checkpoints, final/), so that resume and synthesis read the same table. A fixed table's
    # training texts are checked too (a folder's were by its data check).
    texts = {split: source.texts(split) for split in source.splits}
    if cfg.text_frontend == "phonemes" and language is None:  # a voice of your own
        language, why = guess_language(texts["train"][1])
        if language is None:
            raise RunError(f"--phonemizer_language: the training transcripts do not say which language your voice "
                           f"speaks ({why}); give it as an espeak-ng voice (en-us, en-gb, fr, es, it, ru, de, ...), "
                           f"or read characters with --text_frontend characters")
        logger.info(f"--phonemizer_language {language}: read off the training transcripts ({why}); recorded with "
                    f"the run; --phonemizer_language chooses another")
    try:
        symbols = Symbols.derived(dataclasses.replace(cfg, phonemizer_language=language), texts["train"][1])
        for split, (ids, split_texts) in texts.items():
            if split != "train" or fixed_table:
                symbols.check(ids, split_texts, split)
    except ValueError as e:
        raise RunError(str(e)) from None
    recorded = {"phonemizer_language": language, "symbols": symbols.chars, "symbols_derived": not fixed_table}
    known = dataclasses.replace(cfg, **recorded)  # what the items are made with: the run's config as main records it
    items = lambda rows: TTSDataset(rows, known)  # noqa: E731
    return source.loaders(train=(items, Collator(known)), valid=(items, Collator(known)), tokenizer=symbols,
                          recorded=recorded)


# What the built-in base shares with the voice started from it: the model's shape, and the mel and
# text units, so that its weights mean the same thing here; and the run settings that make it exact.
# Not the thread count: the base uses the machine's cores (`num_threads` auto), so that one machine
# has one base whatever the voices' threads (the same command gives the same base on it, first or not).
BASE_FIELDS = ("sample_rate", "n_mels", "win_length", "hop_length", "text_frontend", "dim", "encoder_layers",
               "decoder_layers", "num_heads", "ffn_dim", "conv_kernel", "duration_channels", "attention_dim",
               "seed", "mixed_precision", "deterministic", "builtin_corpus")
# The base's speed for the time the start log estimates: 1.87 steps/s, 2 threads alone on a 2-core VM
# (benchmarks/new_voice.py, results/README.md: "A new voice on a fresh machine"; 2.5 on an earlier VM).
BASE_STEPS_PER_S = 1.87


def init_folder(cfg: Config, hours: float | None) -> Path | None:
    """The sealed folder --init_from names (None: from scratch). `builtin` (`auto`: when the `hours` of
    training data are few; common/training/builtin_base.py): this script's run on the built-in corpus
    (`base_config`, this run's BASE_FIELDS; English phonemes for a phoneme model), trained once per
    machine (every rank may call: one trains, the others wait); the built-in voice itself has none."""
    if cfg.init_from is None:
        return None
    if cfg.init_from not in (BUILTIN, INIT_AUTO):
        return resolve_checkpoint(cfg.init_from, "--init_from")
    args = base_args(cfg, BASE_FIELDS)
    if cfg.text_frontend == "phonemes":  # the built-in voice speaks English
        args += ["--phonemizer_language", "en-us", "--symbols", AUTO]
    if not start_from_base(Path(__file__), cfg, args, hours, BASE_STEPS_PER_S, log=logger.info):
        return None
    return builtin_base(Path(__file__), args, cfg.data_cache_dir, log=logger.info) / "final"  # its seal checked there


def build_models(cfg: Config, data: RecipeData) -> dict:
    """The model (model.build_model: synthesis builds it there too) for the data's symbol table; on a
    fresh start (not `data.resumes`: a resume loads its checkpoint, the start it had is in there)
    initialized from --init_from (every rank: `init_folder`)."""
    model = build_model(cfg, data.tokenizer.chars)
    logger.info(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
                f"{len(data.tokenizer) - 1} symbols")
    if not data.resumes:
        try:
            folder = init_folder(cfg, data.summary.get("hours"))  # (None for a stream: not read ahead)
            if folder is not None:
                logger.info(transfer_from(model, data.tokenizer.chars, folder, checkpoint_weights(folder)))
        except ValueError as e:
            raise RunError(str(e)) from None
    return {"model": model}


def build_optimizers(cfg: Config, models: dict) -> tuple[dict, dict]:
    """AdamW (no decay on biases and norms) and its schedule, sized in optimizer steps."""
    return adamw_scheduled(cfg, decay_groups(models["model"], cfg.weight_decay))


def compute_loss(models: dict, batch: dict, cfg: Config, step: int) -> tuple[dict, dict]:
    """The weighted sum of the mel, duration, alignment and, from binarization_start_steps on, the
    binarization losses; and (logged) each of them."""
    binarize = cfg.binarization_start_steps is not None and step >= cfg.binarization_start_steps  # same on every rank
    out = models["model"](batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"], batch["log_prior"],
                          binarize)
    loss = (out["mel_loss"] + cfg.duration_loss_weight * out["dur_loss"] + cfg.length_loss_weight * out["len_loss"]
            + cfg.align_loss_weight * out["align_loss"])
    if binarize:
        loss = loss + cfg.binarization_loss_weight * out["bin_loss"]
    return {"model": loss}, {"loss": loss, **{k: out[k] for k in LOSSES}}


@torch.no_grad()
def log_samples(model, items, rows, cfg: Config, writer, vocoder, step: int) -> None:
    """Main process only: predicted vs target mel, the soft and hard alignment, and Griffin-Lim
    audio of the validation `rows` (`items.item(row)`; no collectives in here)."""
    model.eval()
    collate = Collator(cfg)
    for i, row in enumerate(rows):
        utt_id, tokens, mel = item = items.item(row)
        batch = collate([item])
        out = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"], batch["log_prior"], False)
        pred, lens, _ = model.infer(tokens[None], torch.tensor([len(tokens)]))
        pred = pred[0, : int(lens[0])]
        lo, hi = float(mel.min()), float(mel.max())
        images = [to_image(pred, lo, hi), to_image(out["pred"][0], lo, hi), to_image(mel, lo, hi)]
        writer.add_image(f"mel/{i}_synth_teacher_forced_target", stack_images(images)[None], step)
        align = stack_images([to_image(out["soft"][0], 0, 1), to_image(out["hard"][0], 0, 1)])
        writer.add_image(f"alignment/{i}_soft_hard", align[None], step)  # symbols up, frames right
        writer.add_audio(f"audio/{i}", vocoder(pred)[None], step, sample_rate=cfg.sample_rate)
        if step == min(cfg.eval_steps, cfg.max_steps):  # the recording, once (at the first validation)
            writer.add_audio(f"audio/{i}_recording", load_row_audio(row, cfg.sample_rate)[None],
                             step, sample_rate=cfg.sample_rate)
    model.train()


def main(cfg: Config) -> None:
    # ---- start: accelerator, output_dir, signals, seed, and where to resume (common/training/run.py) ----
    # The checkpoint is chosen before the data: its global batch sizes the training batches
    # (run.global_batch), and resume_from_checkpoint restores it after accelerator.prepare.
    run = start_run(cfg, recipe=Path(__file__).parent.name)
    accelerator, out, cfg, accumulation, preemption = run.accelerator, run.out, run.cfg, run.accumulation, run.preemption

    # ---- data, model, optimizer (the seams above) ---------------------------------------------
    data = build_data(cfg, accelerator, out, global_batch=run.global_batch, num_workers=run.num_workers)
    data.resumes = run.ckpt is not None  # what build_models reads: a resume loads its checkpoint over the models
    # What the data decided (the symbol table, the language read off the transcripts) is recorded with
    # the run: config.yaml, checkpoints (a resume compares it) and final/ (synthesis reads it back).
    cfg = dataclasses.replace(cfg, **data.recorded)
    run = dataclasses.replace(run, cfg=cfg, cfg_dict=config_to_dict(cfg))
    models = build_models(cfg, data)  # --init_from read here, on a fresh start
    model = models["model"]
    optimizers, schedulers = build_optimizers(cfg, models)
    optimizer, scheduler = optimizers["model"], schedulers["model"]
    # The scheduler is not prepared: it steps once per optimizer step in end_step (accelerate #1382).
    check_fsdp_wrap(accelerator, model)  # FSDP: the profile's shard unit must exist in this model
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, data.train_loader, data.valid_loader)
    # --ema_decay: the weights validation scores and final/ exports (registered: resumed with the run)
    average = start_average(accelerator, model, cfg.ema_decay)
    # --early_stopping_patience: the run ends when validation stops improving; final/ holds the best one's weights
    stopper = start_early_stopping(accelerator, cfg, run.ckpt, {"model": model}, data.summary.get("hours"))

    # ---- resume, or start: global feature statistics (computed once, broadcast, checkpointed) --
    # What the run is made of: a resume refuses another config (but for the fields that may change on
    # resume) or other training data.
    parts = dict(models=model, optimizers=optimizer, schedulers=scheduler)  # what a checkpoint holds
    state = TrainState.for_run(cfg, accelerator.num_processes, accumulation, data=data.summary)
    if resume_from_checkpoint(accelerator, run.ckpt, state, **parts) is None:  # evenly spaced rows: over the sorted ids
        set_feature_stats(accelerator, model, lambda: feature_stats(  # (id, (frames, n_mels)) pairs
            (utt_id, mel) for utt_id, _, mel in (data.train_items.item(row) for row in data.sample_rows(cfg.stats_utterances))))
    metrics = start_logging(run, state)  # config.yaml, metrics.jsonl and trackers from state.step on
    writer = vocoder = None
    if accelerator.is_main_process and "tensorboard" in trackers(cfg.report_to):
        writer = accelerator.get_tracker("tensorboard", unwrap=True)  # the SummaryWriter
        samples = data.valid_rows(cfg.num_samples)  # the validation sentences synthesized at each validation
        vocoder = GriffinLim(mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length),
                             n_iter=cfg.griffin_lim_iters)

    # ---- training loop ----------------------------------------------------------------------
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    throughput = Throughput(accelerator, data.durations)  # audio s/s
    window = WindowMeans()  # loss, mel, dur, align, bin: means over the accumulation window
    for batch, micro in train_batches(  # resumes mid-epoch, reseeds dropout from the position
            accelerator, train_loader, state, max_steps=cfg.max_steps, accumulation=accumulation,
            seed=cfg.seed, epoch_objects=data.epoch_objects,
            ids_log=out / f"batch_ids.rank{accelerator.process_index}.jsonl" if cfg.dump_batch_ids else None):
        with no_sync_unless(accelerator, model, micro.sync):
            losses, stats = compute_loss({"model": model}, batch, cfg, state.step)
            accelerator.backward(losses["model"] / micro.window_len)  # the mean over the window's batches
        window.add(stats, micro.window_len)
        throughput.add(batch)
        if not micro.sync:
            continue
        grad_norm = optimizer_update(accelerator, model, optimizer, state, max_grad_norm=cfg.max_grad_norm,
                                     max_nonfinite_updates=cfg.max_nonfinite_updates)
        end_step(state, scheduler)
        if average is not None:
            average.update(accelerator.unwrap_model(model))
        bar.update(1)

        row = {}
        if validation_due(state, cfg.eval_steps, cfg.max_steps):  # every eval_steps, and at the end
            with swapped_in(average, model):
                row = evaluate(model, valid_loader, accelerator)  # collective
                stopper.after_validation(state, row)  # collective; keeps these (averaged) weights if the best
                if writer is not None:  # main process only; no collectives inside
                    log_samples(accelerator.unwrap_model(model), data.valid_items, samples, cfg, writer, vocoder, state.step)
            logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            row = metrics.log_step(state, window, throughput, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm,
                                   extra=row)  # collective
            bar.set_postfix(audio_s_per_s=f"{row['audio_s_per_s']:.0f}", loss=f"{row['loss']:.3f}", mel=f"{row['mel_loss']:.3f}")
        window.zero()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: final/ appears complete or not at all -------------------------------------
    def write_extras(folder: Path) -> None:  # main process, beside model.safetensors (incl. feature stats)
        save_config(cfg, folder / "config.yaml")
        (folder / "symbols.json").write_text(json.dumps({"symbols": cfg.symbols}) + "\n")
        write_code(folder, "tts", exported_code())  # the synthesis code: final/ loads without this repository
        write_model_card(folder, recipe=Path(__file__).parent.name, state=state, data_dir=data.data_dir, metrics_path=out / "metrics.jsonl",
                         ended=stopper.card_line(state.step), usage="""
            Needs torch, torchaudio, numpy, safetensors, PyYAML and transformers (pip), nothing of the
            repository that trained it (and espeakng-loader for a phoneme model):

            ```python
            import sys

            sys.path.insert(0, "<this folder>")  # its code: tts_model.py and the tts_*.py it imports
            import tts_audio as audio
            import tts_model as tts

            model, cfg, symbols, _ = tts.load_tts("<this folder>")
            wav, mel, durations = tts.synthesize(model, symbols, "a radio wrote this clever pencil",
                                                 audio.make_vocoder(cfg, n_iter=60))  # wav at cfg.sample_rate
            ```

            With a checkout of that repository on sys.path, `common.training.sealed_import.import_export("<this folder>",
            "tts_model")` imports the same code after checking the folder against its COMPLETE digests.""")

    with swapped_in(average, model), stopper.kept_weights():  # final/ holds the average (the best validation's)
        export_final(accelerator, model, out, write_extras)  # collective
    accelerator.end_training()

if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
