"""A neural vocoder for the TTS recipe's mels: a Vocos-style generator (ConvNeXt at the mel frame rate
+ inverse-STFT head; Siuzdak 2023) trained against HiFi-GAN's multi-period and a multi-resolution STFT
discriminator (least-squares GAN, feature matching, L1 mel loss), with Hugging Face Accelerate.

    # built-in single-voice espeak-ng corpus (LJSpeech layout), 1 process
    accelerate launch recipes/vocoder/train.py
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/vocoder/train.py
    # the vocoder of a TTS run (its data, held-out split and mel), into outputs/tts_fr/vocoder, where the TTS
    # tools (synthesize.py, score.py) find it; a small voice starts from the built-in base (--init_from auto)
    accelerate launch recipes/vocoder/train.py --tts_run outputs/tts_fr
    # a real voice (LJSpeech layout)
    accelerate launch recipes/vocoder/train.py --data_dir /data/LJSpeech-1.1
    # a `datasets` source (train/validation splits), its parquet shards streamed in place
    accelerate launch recipes/vocoder/train.py --dataset_name data/my_voice_parquet \
        --streaming true --per_device_train_batch_size 16
    # then: copy-synthesis scores against Griffin-Lim, and text → TTS → this vocoder
    python recipes/vocoder/evaluate.py --checkpoint outputs/vocoder
    python recipes/tts/synthesize.py --checkpoint outputs/tts_fr --text "une radio a écrit ce crayon"  # its vocoder
    python recipes/tts/synthesize.py --checkpoint outputs/tts --vocoder outputs/vocoder --text "a radio wrote this clever pencil"

Two models (the generator; the discriminators, held as one model), two AdamW and two schedules
through one Accelerator. Each optimizer step: the discriminators' update, then the generator's
(before --gan_start_steps: the generator's alone, on the mel loss). Re-running the same command with
the same --output_dir resumes from the newest complete checkpoint and ends bit-identical to a run that
was never interrupted (on CPU; see the top-level README "Resume"). The seams above `main` (build_data,
build_models, build_optimizers, compute_loss: README.md, "Adapt a recipe") are what the benchmarks and
tests build the recipe with.
Outputs: <output_dir>/final/{model.safetensors (the generator), config.yaml, vocoder_model.py, README.md}.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import DatasetConfig, exit_on_signals_during_start_up, parse_config
from common.config_rules import (Count, ExistingPath, ExistingPathOr, MayBeEmpty, NonNegative, Positive, Range,
                                 ResumeSafe, convert_value, field_specs)
from common.config_yaml import load_yaml


@dataclass
class Config(DatasetConfig):
    """Vocoder training. Every field can be set in the YAML (--config) or as --key value; the shared
    ones (run, data and a `datasets` source, optimization, logging) and their rules are RunConfig's
    and DatasetConfig's (common/config.py)."""

    # RunConfig's settings with this recipe's defaults
    output_dir: str = "outputs/vocoder"
    metric_for_best_model: Literal["eval_mel_loss"] = "eval_mel_loss"
    data_dir: str | None = None  # LJSpeech-layout root (wavs/ + metadata.csv) or an audiofolder (metadata.csv: file_name,...); None = built-in corpus
    sample_rate: int = 22050  # Hz: the TTS recipe's
    max_seconds: float = 15.0  # longer utterances are refused by the data check
    max_batch_seconds: float = 24.0  # padded seconds of whole utterances per batch, per process (each gives one segment)
    learning_rate: float = 5e-4  # both optimizers, after warm-up
    warmup_steps: int = 1  # optimizer steps of linear warm-up (1: none), then lr_decay per step
    weight_decay: float = 0.01  # AdamW (HiFi-GAN's), on weight matrices
    adam_beta1: float = 0.8  # HiFi-GAN's betas
    adam_beta2: float = 0.99
    max_grad_norm: float = 100.0  # per optimizer; GAN gradients are large, this only stops blow-ups
    # --- data ---
    num_valid: Annotated[int, NonNegative] = 20  # validation utterances: the num_valid ids just before the test ids
    num_test: Annotated[int, NonNegative] = 20  # held-out utterances for evaluate.py: the last num_test ids (as the TTS recipe's)
    FOLDER_ONLY = dict.fromkeys(("num_valid", "num_test"), "--eval_split_name validates and no test utterances are "
                                "held out (evaluate.py takes --data_dir)")
    READS_TEXT = False
    # RunConfig's settings this recipe has no use for: not in --help, refused when given (RunConfig's docstring)
    LEFT_OUT = {"stats_utterances": "the generator reads log-mels as they are, without mean/std statistics"}
    segment_frames: Annotated[int, Count] = 32  # mel frames per training segment (32 × 256 = 8192 samples, 0.37 s: HiFi-GAN's)
    # --- the mel (must equal the TTS model's: synthesize.py --vocoder refuses another) ---
    n_mels: Annotated[int, Count] = 80  # log-mel bins (HTK scale, 0 Hz to Nyquist)
    win_length: Annotated[int, Count] = 1024  # samples; n_fft is the next power of two ≥ it
    hop_length: Annotated[int, Count] = 256  # samples per mel frame
    # --- generator ---
    dim: Annotated[int, Count] = 256  # ConvNeXt width
    hidden_dim: Annotated[int, Count] = 768  # ConvNeXt pointwise MLP width
    layers: Annotated[int, Count] = 6  # ConvNeXt blocks
    # The head predicts a correction to the mel's least-squares inverse magnitude (what Griffin-Lim starts
    # from; FreeV) instead of the whole log magnitude: results/vocoder/RESULTS.md, "The magnitude prior"
    magnitude_prior: bool = False
    # At synthesis only (`vocode`, evaluate.py, the TTS tools): the head's magnitude scaled to the mel's band
    # energies, then this many Griffin-Lim iterations from its phases. 0 = the network's output as trained.
    refine_iters: Annotated[int, NonNegative, ResumeSafe] = 0  # results/vocoder/RESULTS.md, "Phase refinement"
    # --- discriminators ---
    # Each list needs at least one value (an empty one would silently drop a discriminator; to train
    # the generator alone, raise --gan_start_steps); periods and n_fft are at most a training segment.
    periods: list[Annotated[int, Count]] = field(default_factory=lambda: [2, 3, 5, 7, 11])  # multi-period discriminator (HiFi-GAN): samples per period
    period_channels: list[Annotated[int, Count]] = field(default_factory=lambda: [16, 64, 128, 128])  # its conv channels (HiFi-GAN: 32 128 512 1024 1024)
    resolutions: list[Annotated[int, Range(4)]] = field(default_factory=lambda: [512, 1024, 2048])  # multi-resolution STFT discriminator: n_fft each (hop n_fft / 4)
    resolution_channels: Annotated[int, Count] = 16  # its conv channels (Vocos: 32)
    # A vocoder output_dir, final/ or checkpoints/step_*/ to start from (another voice): its generator, and its
    # discriminators from a checkpoint (results/vocoder/RESULTS.md, "Transfer"). `builtin`: this recipe's run on the built-in corpus
    # (`base_config`, with this run's mel, model shape and `builtin_corpus`), trained once per machine into the
    # corpus cache (common/training/builtin_base.py), its last checkpoint (generator and discriminators); for
    # the built-in voice itself: from scratch. `auto`: `builtin` for small training data, from scratch above.
    init_from: Annotated[str | None, ExistingPathOr("builtin", "auto")] = None  # auto: under 10 h of training data, first trains a second model, the built-in base (this recipe on the built-in voice, once per machine, then cached: minutes on a CPU, estimated in the start log), and starts from it; 10 h or more: from scratch. builtin: the base always; none: from scratch; or a vocoder run to start from
    base_config: Annotated[str | None, ExistingPath] = None  # the built-in base's YAML (None: this recipe's config.yaml, 1000 steps)
    # The TTS run (its --output_dir) this vocoder is for: its data settings (TTS_RUN_DATA: the same utterances
    # and held-out split) are read from its config.yaml, its mel must be this one's, and output_dir is
    # <tts_run>/vocoder unless given, where the TTS tools' `--vocoder auto` finds it (`complete`).
    tts_run: Annotated[str | None, ExistingPath] = None  # a TTS run's --output_dir: train its voice's vocoder, on its data and held-out split, into <tts_run>/vocoder (its TTS tools then use it)
    # --- losses and schedule ---
    lr_decay: Annotated[float, Range(0, 1, lo_open=True)] = 0.99995  # LR × this per optimizer step, both schedules
    mel_loss_weight: Annotated[float, NonNegative] = 45.0  # HiFi-GAN's, on its scale (L1 of log10 mel amplitude)
    # More mel L1 terms at other window lengths (samples; hop window / 4, n_mels scaled with the window, so
    # 2048 → 160 bins of ~19 Hz at 200 Hz): the L1 is then the mean over the input mel and these (DAC's
    # multi-scale mel loss). A longer window resolves the voice's fundamental and first harmonics.
    mel_resolutions: Annotated[list[Annotated[int, Range(64)]], MayBeEmpty] = field(default_factory=list)  # empty: none
    # Spectral convergence ‖|S| − |Ŝ|‖ / ‖|S|‖ of the linear STFT magnitude, mean over n_fft 1024 and 2048
    # (Parallel WaveGAN's multi-resolution STFT loss, its SC half): unlike the log-mel L1, it weights the
    # strong bins (the fundamental's and first harmonics') most. 0 = off.
    sc_loss_weight: Annotated[float, NonNegative] = 0.0
    # APNet's anti-wrapping phase losses (Ai & Ling 2023) on the phase the head predicts against the recording's
    # STFT phase: its value (IP), differences along frequency (group delay) and along time (instantaneous
    # frequency), each bin weighted by the recording's magnitude (the harmonics, not the noise, whose phase
    # the mel does not determine). 0 = off.
    phase_loss_weight: Annotated[float, NonNegative] = 0.0
    # 1 − STOI of each training segment, differentiable (`envelope_loss`: its one-third-octave band envelopes
    # and their correlation with the recording's; Kolbæk et al. 2018 trained on it): what STOI scores,
    # which the mel loss at 80 bins leaves to chance at the fundamental's bands. 0 = off.
    envelope_loss_weight: Annotated[float, NonNegative] = 0.0
    fm_loss_weight: Annotated[float, NonNegative] = 2.0  # feature matching (HiFi-GAN's)
    gan_start_steps: Annotated[int, NonNegative] = 0  # optimizer steps of generator-only training on the mel loss first
    # --- logging ---
    num_samples: Annotated[int, NonNegative, ResumeSafe] = 2  # validation utterances vocoded into TensorBoard at each validation

    def complete(self, given: set[str]) -> "Config":
        """With --tts_run: this config with that run's data settings (`tts_run_settings`) and, unless `given`
        (by the user), output_dir <tts_run>/vocoder. Refuses (ValueError, one line) a folder that is not a
        TTS run's output_dir, a data setting given here that is not the run's, another mel."""
        if self.tts_run is None:
            return self
        taken, mel = tts_run_settings(Path(self.tts_run))
        types = field_specs(type(self))
        taken, mel = ({key: convert_value(key, v, types[key][0]) for key, v in d.items()} for d in (taken, mel))
        for key, value in taken.items():
            if key in given and getattr(self, key) != value:
                raise ValueError(f"--{key} {getattr(self, key)}: this vocoder reads it from --tts_run {self.tts_run} "
                                 f"({key} {value}), whose held-out utterances it must hold out too: drop --{key}")
        differ = [key for key, value in mel.items() if getattr(self, key) != value]
        if differ:
            raise ValueError(f"--tts_run {self.tts_run}: its TTS model predicts another mel than this vocoder's ("
                             + ", ".join(f"{k} {mel[k]} there, {getattr(self, k)} here" for k in differ) + "): give this vocoder "
                             + " ".join(f"--{k} {mel[k]}" for k in differ))
        output_dir = self.output_dir if "output_dir" in given else str(Path(self.tts_run) / "vocoder")
        return dataclasses.replace(self, **taken, output_dir=output_dir)

    def validate(self) -> None:
        super().validate()
        segment = self.segment_frames * self.hop_length  # samples each training step discriminates
        for name in ("periods", "resolutions", "mel_resolutions"):
            too_long = [v for v in getattr(self, name) if v > segment]
            if too_long:
                raise ValueError(f"--{name}: {too_long[0]} is longer than a training segment ({segment} samples = "
                                 f"--segment_frames {self.segment_frames} × --hop_length {self.hop_length}): lower it "
                                 f"or raise --segment_frames")
        if self.envelope_loss_weight:
            frame = _model_py().envelope_frame(self.sample_rate)
            if segment < 2 * frame + 7 * frame // 2:  # its zero-padded STFT, 8 frames
                raise ValueError(f"--envelope_loss_weight: a training segment ({segment} samples) holds fewer than its 8 "
                                 f"frames of {frame} samples: raise --segment_frames")
        if self.sc_loss_weight and max(_model_py().SC_RESOLUTIONS) > segment:
            raise ValueError(f"--sc_loss_weight: its {max(_model_py().SC_RESOLUTIONS)}-sample STFT is longer than a training "
                             f"segment ({segment} samples): raise --segment_frames or set --sc_loss_weight 0")


# What --tts_run takes from the TTS run's config.yaml (`complete`): where its data is and how it was split and
# checked, so that this vocoder trains on its training utterances and holds out its validation and test ones
# (score.py scores the chain on sentences neither model heard). The built-in corpus's profile and cache when
# that is its data; a folder's duration and rate rules (they decide which utterances are in the split).
TTS_RUN_DATA = ("data_dir", "dataset_name", "dataset_config_name", "train_split_name", "eval_split_name",
                "audio_column_name", "num_valid", "num_test")
TTS_RUN_BUILTIN = ("builtin_corpus", "data_cache_dir")
TTS_RUN_FOLDER = ("min_seconds", "max_seconds", "wrong_sample_rate", "on_bad_data")
MEL_FIELDS = ("sample_rate", "n_mels", "win_length", "hop_length")  # the TTS model's output, this vocoder's input


def tts_run_settings(run: Path) -> tuple[dict, dict]:
    """(the data settings --tts_run takes, the mel it checks) from `run`'s config.yaml, read as YAML data
    (recipes never import each other). Refuses (ValueError) what is not a TTS training output_dir."""
    path = run / "config.yaml"
    what = "give the --output_dir of a recipes/tts training run"
    if not run.is_dir():
        raise ValueError(f"--tts_run {run} does not exist: {what}")
    if (run / "COMPLETE").exists():  # a sealed final/ or checkpoint: this vocoder's output_dir would be inside it
        raise ValueError(f"--tts_run {run} is a sealed export or checkpoint: {what} (the folder that holds final/)")
    if not path.is_file():
        raise ValueError(f"--tts_run {run}: no config.yaml in it (not a training output_dir, or a launch that has "
                         f"not started yet): {what}")
    tts = load_yaml(path)
    missing = [k for k in ("symbols", *TTS_RUN_DATA, *TTS_RUN_BUILTIN, *TTS_RUN_FOLDER, *MEL_FIELDS) if k not in tts]
    if missing:
        raise ValueError(f"--tts_run {run}: its config.yaml has no {missing[0]} (not a TTS run's): {what}")
    return {k: tts[k] for k in tts_run_keys(tts["data_dir"], tts["dataset_name"])}, {k: tts[k] for k in MEL_FIELDS}


def tts_run_keys(data_dir: str | None, dataset_name: str | None) -> tuple[str, ...]:
    """The settings a TTS run on this data decides for its vocoder (TTS_RUN_DATA and the rest above)."""
    return (TTS_RUN_DATA + (TTS_RUN_BUILTIN if data_dir is None and dataset_name is None else ())
            + (TTS_RUN_FOLDER if dataset_name is None else ()))


@functools.cache
def _model_py():
    """This folder's model.py, for Config.validate: loaded from its path (validate runs before the imports
    below when this script starts, and after them with this folder off sys.path when tests and benchmarks
    import it), and only for the losses whose limits it states (it imports torch)."""
    spec = importlib.util.spec_from_file_location("_vocoder_model_rules", Path(__file__).with_name("model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The test model: what tests/ and benchmarks/ add to this recipe's config.yaml to train it in seconds on
# the tiny built-in corpus (a copy keeps its own: docs/adapt.md, "How the tests pick up the copy").
TEST_TINY = ["--dim", "16", "--hidden_dim", "32", "--layers", "1", "--periods", "2,3", "--period_channels", "4,4",
             "--resolutions", "256,512", "--resolution_channels", "4", "--segment_frames", "12", "--num_valid", "2",
             "--num_test", "2"]

if __name__ == "__main__":  # --help and config mistakes are answered before the slow imports below
    exit_on_signals_during_start_up()
    CONFIG = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))

import torch  # noqa: E402
from accelerate.utils import DistributedType, extract_model_from_parallel  # noqa: E402

from common.training.builtin_base import AUTO, KEYWORD as BUILTIN, base_args, builtin_base, start_from_base  # noqa: E402
from common.training.checkpoint import export_final, model_weights_files  # noqa: E402
from common.training.resume import resume_from_checkpoint  # noqa: E402
from common.training.sealing import find_latest_checkpoint, resolve_checkpoint  # noqa: E402
from common.training.state import TrainState  # noqa: E402
from common.training.early_stopping import start_early_stopping  # noqa: E402
from common.config import save_config  # noqa: E402
from common.training.faults import RunError, run_main  # noqa: E402
from common.model.hf_export import write_code, write_model_card  # noqa: E402
from common.training.logs import Throughput, WindowMeans, get_logger, progress_bar, trackers  # noqa: E402
from common.training.loop import (end_step, no_sync_unless, optimizer_update, save_or_preempt, train_batches,  # noqa: E402
                         validation_due)
from common.training.run import start_logging, start_run  # noqa: E402
from common.data.manifest import split_manifest  # noqa: E402
from common.data.source import RecipeData, Source  # noqa: E402
from tools.corpus import resolve_data_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from data import SegmentCollator, Waveforms, collate_whole, extra_mel_frontends, loss_frontend  # noqa: E402
from model import (build_discriminators, build_generator, evaluate, generator_loss, log_samples, lsgan_d_loss,  # noqa: E402
                   transfer_from)

logger = get_logger(__name__)


# ---- the recipe's seams: main below, the benchmarks and the tests build the recipe through these ---

def build_data(cfg: Config, accelerator, out: Path, *, global_batch: int, num_workers: int) -> RecipeData:
    """Whole utterances (no transcripts read): training batches of random segments, validation of whole
    utterances, on the source (common/data/source.py): an LJSpeech-layout folder split into
    training/validation/test by id (the TTS recipe's split), or --dataset_name (its
    --train_split_name trains, its --eval_split_name validates)."""
    source = Source.open(cfg, accelerator, out, global_batch=global_batch, num_workers=num_workers,
                         corpus=lambda: resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "ljspeech"),
                         splits=lambda data_dir, check: split_manifest(check("all", None), cfg.num_valid, cfg.num_test))
    items = lambda rows: Waveforms(rows, cfg.sample_rate)  # noqa: E731
    return source.loaders(train=(items, SegmentCollator(cfg)), valid=(items, collate_whole))


# What the built-in base shares with the voice started from it: the mel and the models' shapes, so that its
# weights mean the same thing here; and the run settings that make it exact. Not the losses nor the segment:
# they shape training, not the weights (the base trains with config.yaml's).
BASE_FIELDS = (*MEL_FIELDS, "dim", "hidden_dim", "layers", "magnitude_prior", "periods", "period_channels", "resolutions",
               "resolution_channels", "seed", "mixed_precision", "deterministic", "builtin_corpus")
# The base's speed for the time the start log estimates: 1.65 steps/s, 2 threads alone on a 2-core VM,
# the built-in corpus (benchmarks/new_voice.py, results/README.md: "A new voice on a fresh machine").
BASE_STEPS_PER_S = 1.65


def init_folder(cfg: Config, hours: float | None) -> Path | None:
    """The sealed folder --init_from names (None: from scratch). `builtin` (`auto`: when the `hours` of
    training data are few; common/training/builtin_base.py): the last checkpoint (generator and
    discriminators) of this script's run on the built-in corpus (`base_config`, this run's BASE_FIELDS),
    trained once per machine (every rank may call: one trains, the others wait)."""
    if cfg.init_from is None:
        return None
    if cfg.init_from not in (BUILTIN, AUTO):
        return resolve_checkpoint(cfg.init_from, "--init_from")
    args = base_args(cfg, BASE_FIELDS)
    if not start_from_base(Path(__file__), cfg, args, hours, BASE_STEPS_PER_S, log=logger.info):
        return None
    base = builtin_base(Path(__file__), args, cfg.data_cache_dir, log=logger.info, checkpoint=True)
    return find_latest_checkpoint(base)  # its seal checked by builtin_base


def build_models(cfg: Config, data: RecipeData) -> dict:
    """The generator, and the discriminators held as one model; on a fresh start (not `data.resumes`: a
    resume loads its checkpoint, the start it had is in there) started from --init_from (every rank:
    `init_folder`; `model.transfer_from`: a checkpoint's both, an export's generator)."""
    models = {"generator": build_generator(cfg), "discriminator": build_discriminators(cfg)}
    if not data.resumes:
        try:
            folder = init_folder(cfg, data.summary.get("hours"))  # (None for a stream: not read ahead)
            if folder is not None:
                # a checkpoint: one file per prepared model (train_state.json names them); an export: the generator
                files = (model_weights_files(folder) if (folder / "train_state.json").is_file()
                         else {"generator": folder / "model.safetensors"})
                logger.info(transfer_from(models, folder, cfg, files))
        except ValueError as e:
            raise RunError(str(e)) from None
    logger.info(f"generator {sum(p.numel() for p in models['generator'].parameters()) / 1e6:.2f} M parameters, "
                f"discriminators {sum(p.numel() for p in models['discriminator'].parameters()) / 1e6:.2f} M")
    return models


def build_optimizers(cfg: Config, models: dict) -> tuple[dict, dict]:
    """One AdamW and one schedule per model: linear warm-up, then × lr_decay per optimizer step."""
    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / cfg.warmup_steps) * cfg.lr_decay ** step

    optimizers, schedulers = {}, {}
    for name, model in models.items():
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                             betas=(cfg.adam_beta1, cfg.adam_beta2))
        schedulers[name] = torch.optim.lr_scheduler.LambdaLR(optimizers[name], schedule)
    return optimizers, schedulers


def compute_loss(models: dict, batch: dict, cfg: Config, step: int) -> tuple[dict, dict]:
    """From --gan_start_steps on, the discriminators' LSGAN loss on real and generated segments; and
    the generator's: mel_loss_weight · L1 mel, plus (from --gan_start_steps on) the LSGAN and
    fm_loss_weight · feature-matching losses through the discriminators outside DDP, back-propagated
    into the generator's parameters only (each optimizer step sees the discriminators of its start).
    The GAN gate is decided here only: `losses` holds "discriminator" from --gan_start_steps on."""
    generator, discriminator = models["generator"], models["discriminator"]
    adversarial = step >= cfg.gan_start_steps  # same on every rank
    real, mels = batch["wavs"], batch["mels"]
    # (B, segment samples); the head's phase (B, bins, frames) for --phase_loss_weight
    fake, phase = generator(mels, with_phase=True) if cfg.phase_loss_weight else (generator(mels), None)
    losses, d_loss = {}, torch.zeros(())
    if adversarial:
        losses["discriminator"] = d_loss = lsgan_d_loss(discriminator, real, fake)
    critic = extract_model_from_parallel(discriminator)  # outside DDP: no reduction of D for the generator's loss
    losses["generator"], stats = generator_loss(critic, loss_frontend(cfg, mels.device), real, fake, mels, cfg,
                                                adversarial, phase, extra_mel_frontends(cfg, mels.device))
    return losses, {"d_loss": d_loss, **stats}


def main(cfg: Config) -> None:
    # ---- start: accelerator, output_dir, signals, seed, and where to resume (common/training/run.py) ----
    run = start_run(cfg, recipe=Path(__file__).parent.name)
    accelerator, out, cfg, accumulation, preemption = run.accelerator, run.out, run.cfg, run.accumulation, run.preemption
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RunError(f"the vocoder recipe runs on one process or DDP, not {accelerator.distributed_type.value}: "
                       f"launch it with accelerate_configs/cpu_ddp.yaml or a DDP GPU profile")

    # ---- data, models, optimizers (the seams above) --------------------------------------------
    data = build_data(cfg, accelerator, out, global_batch=run.global_batch, num_workers=run.num_workers)
    data.resumes = run.ckpt is not None  # what build_models reads: a resume loads its checkpoint over the models
    models = build_models(cfg, data)  # --init_from read here
    generator, discriminator = models["generator"], models["discriminator"]
    optimizers, schedulers = build_optimizers(cfg, models)
    # The schedulers are not prepared: each steps once per optimizer step in end_step (accelerate #1382).
    generator, discriminator, g_opt, d_opt, train_loader, valid_loader = accelerator.prepare(
        generator, discriminator, optimizers["generator"], optimizers["discriminator"], data.train_loader,
        data.valid_loader)
    frontend = loss_frontend(cfg, accelerator.device)

    # ---- resume, or start ------------------------------------------------------------------
    parts = dict(models={"generator": generator, "discriminator": discriminator},
                 optimizers={"generator": g_opt, "discriminator": d_opt}, schedulers=schedulers)
    # --early_stopping_patience: the run ends when validation stops improving; final/ holds the best one's generator
    stopper = start_early_stopping(accelerator, cfg, run.ckpt, {"generator": generator}, data.summary.get("hours"))
    state = TrainState.for_run(cfg, accelerator.num_processes, accumulation, data=data.summary)
    resume_from_checkpoint(accelerator, run.ckpt, state, **parts)
    metrics = start_logging(run, state)
    writer = None
    if accelerator.is_main_process and "tensorboard" in trackers(cfg.report_to):
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        samples = data.valid_rows(cfg.num_samples)  # the validation utterances vocoded at each validation

    # ---- training loop ----------------------------------------------------------------------
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    generator.train()
    discriminator.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    segment_s = cfg.segment_frames * cfg.hop_length / cfg.sample_rate
    throughput = Throughput(accelerator, defaultdict(lambda: segment_s))  # segment audio s/s (every utterance gives one)
    window = WindowMeans()
    for batch, micro in train_batches(  # resumes mid-epoch, reseeds the global RNG from the position
            accelerator, train_loader, state, max_steps=cfg.max_steps, accumulation=accumulation,
            seed=cfg.seed, epoch_objects=data.epoch_objects,
            ids_log=out / f"batch_ids.rank{accelerator.process_index}.jsonl" if cfg.dump_batch_ids else None):
        # (before --gan_start_steps the discriminators run no DDP forward or backward: no_sync changes nothing for them)
        with no_sync_unless(accelerator, (generator, discriminator), micro.sync):
            losses, stats = compute_loss({"generator": generator, "discriminator": discriminator}, batch, cfg,
                                         state.step)
            adversarial = "discriminator" in losses  # compute_loss's GAN gate: the same on every rank
            if adversarial:  # the discriminators' gradients come from their own loss only
                accelerator.backward(losses["discriminator"] / micro.window_len)
            accelerator.backward(losses["generator"] / micro.window_len, inputs=list(generator.parameters()))
        window.add(stats, micro.window_len)
        throughput.add(batch["ids"])
        if not micro.sync:
            continue
        # The discriminators' update, then the generator's: the generator's gradients above were taken
        # against the discriminators of this step's start (accumulation needs every micro-batch to see the same D).
        d_norm = torch.zeros(())
        if adversarial:
            d_norm = optimizer_update(accelerator, discriminator, d_opt, state, max_grad_norm=cfg.max_grad_norm,
                                      max_nonfinite_updates=cfg.max_nonfinite_updates)
        g_norm = optimizer_update(accelerator, generator, g_opt, state, max_grad_norm=cfg.max_grad_norm,
                                  max_nonfinite_updates=cfg.max_nonfinite_updates)
        end_step(state, schedulers["generator"], *([schedulers["discriminator"]] if adversarial else []))
        bar.update(1)

        row = {}
        if validation_due(state, cfg.eval_steps, cfg.max_steps):  # every eval_steps, and at the end
            row = evaluate(accelerator.unwrap_model(generator), valid_loader, frontend, accelerator)  # collective
            stopper.after_validation(state, row)  # collective; keeps the generator's weights if the best
            logger.info(f"step {state.step}: eval_mel_loss {row['eval_mel_loss']:.4f}")
            if writer is not None:  # main process only; no collectives inside
                log_samples(accelerator.unwrap_model(generator), data.valid_items, samples, frontend, cfg, writer, state.step)
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            row = metrics.log_step(state, window, throughput, lr=schedulers["generator"].get_last_lr()[0],
                                   grad_norm=g_norm, extra={"d_lr": schedulers["discriminator"].get_last_lr()[0],
                                                            "d_grad_norm": d_norm.item(), **row})  # collective
            bar.set_postfix(mel=f"{row['mel_loss']:.3f}", d=f"{row['d_loss']:.3f}")
        window.zero()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: final/ (the generator) appears complete or not at all --------------------------
    def write_extras(folder: Path) -> None:  # main process, beside model.safetensors
        save_config(cfg, folder / "config.yaml")  # holds the mel settings synthesize.py --vocoder checks
        # The model code under a name of its own (`model` would collide with a TTS model's on sys.path).
        write_code(folder, "vocoder", {"model": Path(__file__).with_name("model.py")})
        write_model_card(folder, recipe=Path(__file__).parent.name, state=state, data_dir=data.data_dir,
                         metrics_path=out / "metrics.jsonl", ended=stopper.card_line(state.step), usage="""
            Needs torch, safetensors and PyYAML (pip), nothing of the repository that trained it:

            ```python
            import sys

            sys.path.insert(0, "<this folder>")  # its code: vocoder_model.py
            import vocoder_model as code

            generator, cfg = code.load_vocoder("<this folder>")
            wav = code.vocode(generator, logmel)  # (frames, cfg.n_mels) natural-log power mel → samples at cfg.sample_rate
            ```

            With a checkout of that repository on sys.path, `common.training.sealed_import.import_export("<this folder>",
            "vocoder_model")` imports the same code after checking the folder against its COMPLETE digests.""")

    with stopper.kept_weights():  # with early stopping on: the best validation's generator
        export_final(accelerator, {"generator": generator}, out, write_extras)  # collective
    accelerator.end_training()


if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
