"""Conformer-CTC speech recognition, from scratch or fine-tuned from BEST-RQ, with Hugging Face Accelerate.

    # built-in espeak-ng corpus, characters, 1 process (CPU or one GPU)
    accelerate launch recipes/asr/train.py
    # a voice of your own (LibriSpeech layout): started from the run above, trained once per machine (README);
    # it stops when its validation CER has not improved in 6 validations, final/ holding the best one's weights
    accelerate launch recipes/asr/train.py --data_dir my_voice --output_dir outputs/asr_my_voice
    # fine-tune a BEST-RQ encoder (same front end and encoder shape): its run, or its exported transformers
    # folder (outputs/best_rq/final/encoder, or a Hub id it was uploaded as), read as any transformers encoder
    accelerate launch recipes/asr/train.py --init_from outputs/best_rq --output_dir outputs/asr_ft
    # fine-tune a transformers speech encoder (wav2vec 2.0, HuBERT, WavLM, w2v-BERT 2.0): a save_pretrained
    # folder or a Hub id, with its own front end; final/ is its stock <Family>ForCTC
    accelerate launch recipes/asr/train.py --init_from facebook/wav2vec2-base --data_dir /data/LibriSpeech \
        --train_split train-clean-100 --valid_split dev-clean --output_dir outputs/asr_w2v2 --mask_time_prob 0.05
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/asr/train.py
    # LibriSpeech 100 h, BPE, GPUs
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/asr/train.py \
        --config recipes/asr/config_librispeech_100h.yaml --data_dir /data/LibriSpeech
    # word and character error rates on the test split
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr --split test
    python recipes/asr/transcribe.py --checkpoint outputs/asr --audio speech.wav  # any audio files

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see the top README "Resume").
Outputs: <output_dir>/final/ (a transformers Wav2Vec2BertForCTC + feature extractor + tokenizer, and our
config.yaml, tokenizer/), <output_dir>/metrics.jsonl.

Adapting it: the data (data.py), the model and its loss (model.py), freezing, what is logged and
evaluated are yours to change; the seams above `main` (build_data, build_models, build_optimizers,
compute_loss: README.md, "Adapt a recipe") are what the benchmarks and tests build the recipe with. The loop's calls into common/training/loop.py carry the exact-resume
and DDP guarantees (docs/resume.md); they check their own order (a bypassed or misplaced one stops the
run with a ContractError saying which), and tests/guarantees/test_contract.py checks that every recipe calls them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import DatasetConfig, exit_on_signals_during_start_up, parse_config
from common.config_rules import Count, ExistingPath, Fraction, Internal, Names, NonNegative, Range, Rule

SUBSETS_DIR = Path(__file__).with_name("subsets")


def subset_file(name: str) -> Path:
    """--train_subset: a named subset (subsets/<name>.txt) or a path."""
    named = SUBSETS_DIR / f"{name}.txt"
    return named if "/" not in name and named.is_file() else Path(name)


@dataclass(frozen=True)
class _SubsetFile(Rule):
    """--train_subset's file must be there: a rule of this machine (a saved config read elsewhere is not held to it)."""

    of_this_machine = True

    def __str__(self) -> str:
        return "10min, 1h or a file of utterance ids"

    def check(self, value) -> str | None:
        if subset_file(value).is_file():
            return None
        return f"{value} is not 10min, 1h ({SUBSETS_DIR}) nor a file of utterance ids"


@dataclass(frozen=True)
class _InitFrom(Rule):
    """--init_from: a path here, `builtin`/`auto`, or a Hub id (owner/name; fetched when the run starts,
    refused there in one line when the Hub cannot give it): a rule of this machine."""

    of_this_machine = True

    def __str__(self) -> str:
        return "must exist, or builtin, auto, or a Hub id owner/name"

    def check(self, value) -> str | None:
        from common.model.hf_encoder import HUB_ID

        if value in ("builtin", "auto") or Path(value).exists() or HUB_ID.match(value):
            return None
        return f"{value} does not exist (nor is it builtin, auto or a Hub id owner/name)"


@dataclass
class Config(DatasetConfig):
    """Conformer-CTC ASR. Every field can be set in the YAML (--config) or as --key value; the
    shared ones (run, data and a `datasets` source, optimization, logging) and their rules are
    RunConfig's and DatasetConfig's (common/config.py)."""

    # RunConfig's settings with this recipe's defaults
    output_dir: str = "outputs/asr"
    data_dir: str | None = None  # LibriSpeech-layout root, datasets.save_to_disk folder, or audiofolders <data_dir>/<split>/metadata.csv (manifest.py); None = built-in corpus
    eval_steps: int = 250  # optimizer steps between validation passes (loss, greedy WER/CER; 0 = never)
    metric_for_best_model: Literal["eval_cer", "eval_wer", "eval_loss"] = "eval_cer"
    # A voice's validation CER can stay flat for 1250 steps and fall again (Spanish: 1750 → 3000 → 4000):
    # 6 validations (1500 steps) without a lower CER end it, and max_steps caps it (results/asr).
    early_stopping_patience: int | None = None  # None = auto: 6 on a voice (your own data under 10 h), off on the built-in corpus
    AUTO_EARLY_STOPPING_PATIENCE = 6
    # --- data ---
    train_split: Annotated[str, Names] = "train"  # subfolder(s) of data_dir, comma-separated (train-clean-100,train-clean-360); --dataset_name: --train_split_name
    valid_split: str = "validation"  # subfolder of data_dir; --dataset_name: --eval_split_name
    FOLDER_ONLY = dict.fromkeys(("train_split", "valid_split"), "use --train_split_name and --eval_split_name")
    train_fraction: Annotated[float, Range(0, 1, lo_open=True)] = 1.0  # labelled subset: the round(fraction·N) training utterances whose ids hash lowest
    train_subset: Annotated[str | None, _SubsetFile()] = None  # fixed labelled subset: 10min or 1h (subsets/<name>.txt beside this file: of --builtin_corpus ssl10h) or a file of utterance ids
    n_mels: Annotated[int, Count] = 80  # log-mel bins, 25 ms window, 10 ms hop
    # --- output tokens ---
    token_type: Literal["char", "bpe"] = "char"  # char: a-z, ', space + the training transcripts' other characters; bpe: SentencePiece trained on them
    bpe_vocab_size: Annotated[int, Count] = 256  # SentencePiece pieces (an upper bound: a small corpus may give fewer)
    char_map: Annotated[str | None, ExistingPath] = None  # file of "<character> <replacement>" lines applied to every normalized transcript (text.py)
    unknown_chars: Literal["error", "drop"] = "error"  # a validation/test character absent from training: refuse, or remove it from target and reference
    # --- augmentation (a pure function of (seed, epoch, utterance id)) ---
    speed_perturb: Annotated[float, Range(0, 1, hi_open=True)] = 0.0  # speed factor drawn from {1-x, 1, 1+x} per utterance and epoch (0 = off)
    freq_masks: Annotated[int, NonNegative] = 2  # SpecAugment frequency masks per utterance
    freq_mask_width: Annotated[int, NonNegative] = 27  # mel bins, maximum width of each
    time_masks: Annotated[int, NonNegative] = 2  # SpecAugment time masks per utterance
    time_mask_width: Annotated[int, NonNegative] = 40  # 10 ms frames, maximum width of each ...
    time_mask_ratio: Annotated[float, Fraction] = 0.2  # ... and at most this fraction of the utterance
    # --- encoder (Conformer, transformers Wav2Vec2BertModel; must match BEST-RQ for --init_from) ---
    stack_frames: Annotated[int, Count] = 4  # 10 ms frames stacked per encoder frame (4 → 40 ms per CTC frame)
    hidden_size: Annotated[int, Count] = 144
    num_layers: Annotated[int, Count] = 4
    num_heads: Annotated[int, Count] = 4
    ffn_dim: Annotated[int, Count] = 576
    conv_kernel: Annotated[int, Count] = 15  # depthwise convolution kernel, in 40 ms frames
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.1  # residual branches and input projection
    attention_dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.1  # on attention probabilities
    activation_dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.1  # on feed-forward activations
    # --- fine-tuning ---
    # A BEST-RQ or ASR output_dir (or final/, a checkpoint, or BEST-RQ's final/encoder: our exports are
    # transformers folders of our log-mel front end, read as any other) to start from: its encoder and
    # feature statistics (an ASR run's CTC head is not taken: the characters are this run's). `builtin`: this recipe's run on the
    # built-in corpus (`base_config`, with this run's front end and encoder shape and its `builtin_corpus`),
    # trained once per machine into the corpus cache (common/training/builtin_base.py; README, "A new
    # voice"); on a built-in corpus itself: from scratch. `auto`: `builtin` for small training data (below
    # builtin_base.AUTO_MAX_HOURS), from scratch above. A fresh run says in one log line which, and the base's cost.
    # A transformers speech encoder (common/model/hf_encoder.py): a `save_pretrained` folder (config.json
    # model_type wav2vec2, hubert, wavlm or wav2vec2-bert; JSON and safetensors only are read) or a Hub id
    # (the same, downloaded): its own front end and feature extractor, its weights, our CTC head; the
    # shape fields above are then its config.json's; final/ is its stock <Family>ForCTC (no remote code).
    init_from: Annotated[str | None, _InitFrom()] = None  # auto: under 10 h of training data, first trains a second model, the built-in base (this recipe on the built-in corpus, once per machine, then cached: minutes on a CPU, estimated in the start log), and starts from it; 10 h or more: from scratch. builtin: the base always; none: from scratch; a BEST-RQ or ASR run to start from; or a transformers encoder: a save_pretrained folder or a Hub id
    base_config: Annotated[str | None, ExistingPath] = None  # the built-in base's YAML (None: this recipe's config.yaml)
    base_max_steps: Annotated[int | None, Count] = None  # the built-in base's optimizer steps (a voice's cap is max_steps); None, or a --base_config that sets max_steps: that YAML's max_steps
    encoder_lr_scale: Annotated[float, NonNegative] = 1.0  # encoder LR = learning_rate × this (head: learning_rate)
    freeze_encoder_steps: Annotated[int, NonNegative] = 0  # optimizer steps during which the encoder is not updated
    layer_decay: Annotated[float, Range(0, 1, lo_open=True)] = 1.0  # encoder block k of N (0 = input projection) learns at encoder LR × this^(N-k)
    # --- a transformers encoder's own settings (transformers' run_speech_recognition_ctc.py names) ---
    freeze_feature_encoder: bool | None = None  # its convolutional waveform front end not trained; None: on for wav2vec2/HuBERT/WavLM (as that script's flag), off for w2v-BERT (which has none)
    layerdrop: Annotated[float, Range(0, 1, hi_open=True)] = 0.0  # probability that a training step skips each Transformer layer
    mask_time_prob: Annotated[float, Fraction] = 0.0  # the model's own SpecAugment: share of encoder frames masked, in spans of mask_time_length (that script: 0.05)
    mask_time_length: Annotated[int, Count] = 10  # encoder frames per time mask (20 ms each)
    mask_feature_prob: Annotated[float, Fraction] = 0.0  # share of hidden channels masked, in spans of mask_feature_length
    mask_feature_length: Annotated[int, Count] = 10  # hidden channels per feature mask
    encoder_type: Annotated[str, Internal] = "conformer"  # set by the program: conformer (log-mel, this file's shape fields), or the transformers model_type --init_from gave
    # --- weight average (common/training/averaging.py) ---
    # > 0: validation, final/ and decode.py of a checkpoint use an exponential moving average of the
    # weights, decay min(ema_decay, (1 + n) / (10 + n)) after n optimizer steps (0 = the trained weights)
    ema_decay: Annotated[float, Range(0, 1, hi_open=True)] = 0.0

    def validate(self) -> None:
        super().validate()  # (the data source's rules: DatasetConfig.validate_changes)
        if self.streaming and (self.train_subset or self.train_fraction < 1.0):
            raise ValueError("--train_subset and --train_fraction choose utterances by id, which a stream cannot "
                             "do without reading it all: drop them, or use --streaming false")
        if self.train_subset is not None:
            if self.train_fraction < 1.0:
                raise ValueError("--train_subset and --train_fraction both choose the labelled utterances: set one")

# The test model: what tests/ and benchmarks/ add to this recipe's config.yaml to train it in seconds on
# the tiny built-in corpus (a copy keeps its own: docs/adapt.md, "How the tests pick up the copy").
TEST_TINY = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64"]

if __name__ == "__main__":  # --help and config mistakes are answered before the slow imports below
    exit_on_signals_during_start_up()  # a Ctrl-C during the imports: one line, not a traceback
    CONFIG = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from common.training.averaging import start_average, swapped_in  # noqa: E402
from common.training.builtin_base import (AUTO, KEYWORD as BUILTIN, base_args, builtin_base,  # noqa: E402
                                          start_from_base, uses_builtin_corpus)
from common.training.checkpoint import export_final  # noqa: E402
from common.training.resume import resume_from_checkpoint  # noqa: E402
from common.training.state import TrainState  # noqa: E402
from common.training.early_stopping import start_early_stopping  # noqa: E402
from common.config import save_config  # noqa: E402
from common.training.distributed import check_fsdp_wrap  # noqa: E402
from common.model.encoder import MATCHING_KEYS  # noqa: E402
from common.model.hf_encoder import (FAMILIES, check_logmel_shape, encoder_weights, is_logmel,  # noqa: E402
                                     load_encoder_weights, load_logmel_encoder, read_pretrained)
from common.training.faults import RunError, run_main  # noqa: E402
from common.model.features import LogMel, feature_stats, set_feature_stats  # noqa: E402
from common.model.hf_export import write_model_card  # noqa: E402
from common.training.logs import Throughput, WindowMeans, get_logger, progress_bar, trackers  # noqa: E402
from common.training.loop import (adamw_scheduled, decay_groups, no_sync_unless,  # noqa: E402
                         optimizer_update, end_step, save_or_preempt, train_batches, validation_due)
from common.training.prepare import prepare_once  # noqa: E402
from common.data.source import RecipeData, Source  # noqa: E402
from common.training.run import start_logging, start_run  # noqa: E402
from tools.corpus import resolve_data_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from data import (PaddingCollator, SpecAugmentCollator, SpeechDataset, fixed_subset, labelled_subset,  # noqa: E402
                  load_wav, read_split, transcribed)
from model import ConformerCTC, ctc_loss, ctc_model, evaluate, export_hf  # noqa: E402
from scoring import Scorer  # noqa: E402
from text import build_tokenizer, check_transcripts, load_tokenizer, read_char_map  # noqa: E402

logger = get_logger(__name__)


# ---- the recipe's seams: main below, the benchmarks and the tests build the recipe through these ---

def build_data(cfg: Config, accelerator, out: Path, *, global_batch: int, num_workers: int) -> RecipeData:
    """Log-mel items with token ids and the SpecAugment collators (the training set only augmented) on
    the source (common/data/source.py): a LibriSpeech-layout folder's train_split and valid_split (or
    `datasets.save_to_disk` folders), or --dataset_name; the labelled subset; and the tokenizer
    (`data.tokenizer`), built once into <out>/tokenizer/ from the training transcripts."""
    source = Source.open(cfg, accelerator, out, global_batch=global_batch, num_workers=num_workers,
                         corpus=lambda: resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "librispeech"),
                         splits=lambda data_dir, check: {name: read_split(data_dir, split, lambda root, s: check(s, s))
                                                         for name, split in (("train", cfg.train_split),
                                                                             ("validation", cfg.valid_split))})
    source.select(lambda splits: labelled(cfg, source.data_dir, splits))
    tokenizer = prepare_tokenizer(cfg, out, source)
    frontend = prepare_frontend(cfg, out)  # a transformers encoder's, or None: log-mel
    if frontend is not None:  # its feature extractor's items; the model masks them itself
        return source.loaders(train=(lambda rows: SpeechDataset(rows, cfg, tokenizer, cfg.speed_perturb, frontend),
                                     PaddingCollator()),
                              valid=(lambda rows: SpeechDataset(rows, cfg, tokenizer, frontend=frontend), PaddingCollator()),
                              tokenizer=tokenizer, recorded={"encoder_type": frontend["model_type"]})
    # Training items are kept per (utterance, speed factor); the training set only is augmented.
    return source.loaders(train=(lambda rows: SpeechDataset(rows, cfg, tokenizer, cfg.speed_perturb),
                                 SpecAugmentCollator(cfg, augment=True)),
                          valid=(lambda rows: SpeechDataset(rows, cfg, tokenizer), SpecAugmentCollator(cfg, augment=False)),
                          tokenizer=tokenizer, recorded={"encoder_type": "conformer"})


def labelled(cfg: Config, data_dir, splits: dict) -> dict:
    """The manifests with transcripts (a `datasets` source's rows without letters left out, as a
    folder's are), the training split cut to --train_subset or --train_fraction."""
    if cfg.dataset_name:
        named = {"train": cfg.train_split_name, "validation": cfg.eval_split_name}
        splits = {name: transcribed(rows, named[name]) for name, rows in splits.items()}
    train = splits["train"]
    if cfg.train_subset:
        try:
            train = fixed_subset(train, subset_file(cfg.train_subset))
        except ValueError as e:
            raise RunError(f"--train_subset {cfg.train_subset}: {e} in {data_dir}/{cfg.train_split} "
                           f"(10min and 1h are subsets of --builtin_corpus ssl10h)") from None
    return {**splits, "train": labelled_subset(train, cfg.train_fraction)}


def prepare_tokenizer(cfg: Config, out: Path, source):
    """The tokenizer: built once into <out>/tokenizer/ by one process, the others wait. Its symbols
    come from the training transcripts; validation characters it cannot emit are refused."""
    try:
        char_map = read_char_map(cfg.char_map) if cfg.char_map else None
    except (OSError, ValueError) as e:
        raise RunError(f"--char_map: {e}") from None
    tok_info = {"token_type": cfg.token_type, "bpe_vocab_size": cfg.bpe_vocab_size, "train_split": cfg.train_split,
                "train_fraction": cfg.train_fraction, "train_subset": cfg.train_subset, "data_dir": cfg.data_dir, **({"char_map": char_map} if char_map else {}),
                **({"dataset_name": cfg.dataset_name, "train_split_name": cfg.train_split_name} if cfg.dataset_name else {})}
    tok_dir = prepare_once(out / "tokenizer", lambda tmp: build_tokenizer(
        cfg.token_type, list(source.texts("train")[1]), tmp, cfg.bpe_vocab_size, char_map), info=tok_info)
    built = json.loads((tok_dir / ".complete").read_text())
    if any(built.get(k) != v for k, v in tok_info.items()):
        raise RuntimeError(f"{tok_dir} was built with other settings ({built}); use a new --output_dir")
    tokenizer = load_tokenizer(tok_dir)
    valid_name = cfg.eval_split_name if cfg.dataset_name else cfg.valid_split
    try:
        check_transcripts(*source.texts("validation"), tokenizer, valid_name, cfg.unknown_chars)
    except ValueError as e:
        raise RunError(str(e)) from None
    logger.info(f"tokens: {cfg.token_type}, {tokenizer.vocab_size} CTC classes (blank included)")
    return tokenizer


def prepare_frontend(cfg: Config, out: Path) -> dict | None:
    """What --init_from names, when it names a folder or a Hub id (downloaded here): its record
    (`read_pretrained`: a transformers encoder folder, or one of our BEST-RQ/ASR runs, whose exports are
    such folders too), written once into <out>/frontend/frontend.json by one process: a resume, decode.py
    and export.py read it there, never the source (which may be gone). None: this recipe's Conformer on
    log-mel (from scratch, the built-in base, or our front end's record, whose shape must be this run's).
    Settings are refused in one line where they cannot apply."""
    init = cfg.init_from
    frontend = None
    if init not in (None, BUILTIN, AUTO) or (out / "frontend").is_dir():
        def build(tmp: Path) -> None:
            (tmp / "frontend.json").write_text(json.dumps(read_pretrained(init), indent=1) + "\n")

        done = prepare_once(out / "frontend", build, info={"init_from": init})
        if json.loads((done / ".complete").read_text()).get("init_from") != init:
            raise RunError(f"{done} was made for another --init_from; use a new --output_dir")
        frontend = json.loads((done / "frontend.json").read_text())
    if frontend is None or is_logmel(frontend):
        own = [k for k in ("layerdrop", "mask_time_prob", "mask_feature_prob") if getattr(cfg, k)]
        if own or cfg.freeze_feature_encoder:
            raise RunError(f"--{(own or ['freeze_feature_encoder'])[0]} is a transformers encoder's setting "
                           f"(--init_from a save_pretrained folder or a Hub id); this run's Conformer masks its "
                           f"log-mel itself (--time_masks, --freq_masks): drop it")
        if frontend is not None:  # refused before any audio is read
            check_logmel_shape(frontend, cfg)
        return None
    rate = frontend["feature_extractor"]["sampling_rate"]
    if rate != cfg.sample_rate:
        raise RunError(f"--sample_rate {cfg.sample_rate}: the {frontend['model_type']} model takes {rate} Hz audio "
                       f"(its preprocessor_config.json): set --sample_rate {rate} (audio is resampled to it on load)")
    if cfg.freeze_feature_encoder and not FAMILIES[frontend["model_type"]].raw:
        raise RunError(f"--freeze_feature_encoder: a {frontend['model_type']} model has no convolutional feature "
                       f"encoder (it reads fbank features): drop it, or freeze the encoder with --freeze_encoder_steps")
    return frontend


# What the built-in base shares with the voice started from it: the front end and encoder shape (its
# weights must fit), and the run settings that make it exact. Its tokens and its CTC head are its own.
# Not the thread count: the base uses the machine's cores (`num_threads` auto), so that one machine
# has one base whatever the voices' threads (the same command gives the same base on it, first or not).
BASE_FIELDS = (*MATCHING_KEYS, "seed", "mixed_precision", "deterministic", "builtin_corpus")
# The base's speed for the time the start log estimates: 10.3 steps/s, 1 process alone on a 2-core VM
# (benchmarks/new_voice.py, results/README.md: "A new voice on a fresh machine").
BASE_STEPS_PER_S = 10.3


def init_folder(cfg: Config, hours: float | None) -> str | Path | None:
    """What --init_from names (None: from scratch). `builtin` (`auto`: when the `hours` of training data
    are few; common/training/builtin_base.py): this script's run on the built-in corpus (`base_config`,
    this run's BASE_FIELDS), trained once per machine (every rank may call: one trains, the others
    wait); a run on a built-in corpus itself has none."""
    if cfg.init_from not in (BUILTIN, AUTO):
        return cfg.init_from
    args = base_args(cfg, BASE_FIELDS)
    if not start_from_base(Path(__file__), cfg, args, hours, BASE_STEPS_PER_S, log=logger.info):
        return None
    return builtin_base(Path(__file__), args, cfg.data_cache_dir, log=logger.info)


def build_models(cfg: Config, data: RecipeData) -> dict[str, ConformerCTC]:
    """The model, its output sized by the data's tokenizer; on a fresh start (not `data.resumes`: a
    resume loads its checkpoint instead) its encoder and feature statistics loaded from --init_from (every
    rank: `init_folder`; `load_logmel_encoder`, `model.stats_given`). A transformers encoder
    (the data's `encoder_type`): `build_hf_model`."""
    cfg = dataclasses.replace(cfg, **data.recorded)
    if cfg.encoder_type != "conformer":
        return {"model": build_hf_model(cfg, data)}
    model = ctc_model(cfg, data.tokenizer.vocab_size)
    # every rank; a resume loads its checkpoint instead (hours: None for a stream, not read ahead)
    folder = init_folder(cfg, data.summary.get("hours")) if not data.resumes else None
    if folder:  # our front end's record: prepare_frontend's of --init_from, or the built-in base's, read here
        recorded = Path(cfg.output_dir) / "frontend" / "frontend.json"
        load_logmel_encoder(model, json.loads(recorded.read_text()) if recorded.is_file() else read_pretrained(folder), cfg)
    model.stats_given = bool(folder)  # the feature statistics came with the encoder
    start = (f"initialized from {folder}" if folder else "resumed" if data.resumes else "from scratch"
             + (" (the built-in corpus: the base of other voices)"
                if cfg.init_from in (BUILTIN, AUTO) and uses_builtin_corpus(cfg) else ""))
    logger.info(f"encoder: {sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters, {start}")
    return {"model": model}


def build_hf_model(cfg: Config, data: RecipeData):
    """A transformers encoder of the recorded front end (<output_dir>/frontend/) + our CTC head; on a
    fresh start its weights from the folder it came from (strictly: `load_encoder_weights`), the
    convolutional feature encoder frozen where --freeze_feature_encoder says (before `prepare`: DDP
    then leaves those parameters out)."""
    frontend = json.loads((Path(cfg.output_dir) / "frontend" / "frontend.json").read_text())
    model = ctc_model(cfg, data.tokenizer.vocab_size, frontend)
    family = FAMILIES[frontend["model_type"]]
    if not data.resumes:
        load_encoder_weights(model.encoder, encoder_weights(frontend["source"]), family.prefix, frontend["source"])
    freeze = family.raw if cfg.freeze_feature_encoder is None else cfg.freeze_feature_encoder
    if freeze:
        model.encoder.feature_extractor._freeze_parameters()
    logger.info(f"encoder: {frontend['model_type']} ({type(model.encoder).__name__}), "
                f"{sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters, "
                f"{'resumed' if data.resumes else 'initialized from ' + frontend['source']}"
                f"{', feature encoder frozen' if freeze else ''}")
    return model


def build_optimizers(cfg: Config, models: dict) -> tuple[dict, dict]:
    """AdamW (no decay on biases and norms) and its schedule, sized in optimizer steps. The head's
    groups first, so that the logged "lr" is the head's; the encoder at encoder_lr_scale × that,
    and with layer_decay < 1 lower blocks slower (BEiT/data2vec's layer-wise decay: the pre-trained
    input side moves least)."""
    model = models["model"]
    groups = decay_groups(model.head, cfg.weight_decay, lr=cfg.learning_rate)
    blocks = encoder_blocks(model.encoder) if cfg.layer_decay < 1 else [model.encoder]  # 1: the encoder's two groups
    for k, block in enumerate(blocks):
        lr = cfg.learning_rate * cfg.encoder_lr_scale * cfg.layer_decay ** (len(blocks) - 1 - k)
        groups += decay_groups(block, cfg.weight_decay, lr=lr)
    return adamw_scheduled(cfg, groups)


def encoder_blocks(encoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The encoder bottom-up: everything outside the Conformer blocks (the input projection), then each block."""
    layers = list(encoder.encoder.layers)
    rest = [p for p in encoder.parameters() if all(p is not q for layer in layers for q in layer.parameters())]
    return [torch.nn.ParameterList(rest), *layers]


def compute_loss(models: dict, batch: dict, cfg: Config, step: int) -> tuple[dict, dict]:
    """The CTC loss of the batch (SpecAugment masks applied)."""
    log_probs, out_lens = models["model"](batch["feats"], batch["feat_lens"], batch.get("time_mask"), batch.get("freq_mask"))
    loss = ctc_loss(log_probs, out_lens, batch["targets"], batch["target_lens"])
    return {"model": loss}, {"loss": loss}


def main(cfg: Config) -> None:
    # ---- start: accelerator, output_dir, signals, seed, and where to resume (common/training/run.py) ----
    # The checkpoint is chosen before the data: its global batch sizes the training batches
    # (run.global_batch), and resume_from_checkpoint restores it after accelerator.prepare.
    run = start_run(cfg, recipe=Path(__file__).parent.name)
    accelerator, out, cfg, accumulation, preemption = run.accelerator, run.out, run.cfg, run.accumulation, run.preemption
    if cfg.deterministic and accelerator.device.type == "cuda":
        raise RunError("--deterministic on a GPU: CUDA's CTC loss backward has no deterministic implementation, "
                       "so this recipe cannot be bit-exact there; drop --deterministic (resume stays exact in "
                       "position and state)")

    # ---- data, tokenizer, model, optimizer (the seams above) -----------------------------------
    data = build_data(cfg, accelerator, out, global_batch=run.global_batch, num_workers=run.num_workers)
    data.resumes = run.ckpt is not None  # what build_models reads: a resume loads its checkpoint over the models
    cfg = dataclasses.replace(cfg, **data.recorded)  # encoder_type: what the checkpoints and config.yaml record
    tokenizer, tok_dir = data.tokenizer, out / "tokenizer"  # built by build_data; exported with the model
    models = build_models(cfg, data)  # --init_from read here, on a fresh start
    model = models["model"]
    optimizers, schedulers = build_optimizers(cfg, models)
    optimizer, scheduler = optimizers["model"], schedulers["model"]
    encoder_params = list(model.encoder.parameters())
    # The scheduler is not prepared: it steps once per optimizer step in end_step (accelerate #1382).
    check_fsdp_wrap(accelerator, model)  # FSDP: the profile's shard unit must exist in this model
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, data.train_loader, data.valid_loader)
    # --ema_decay: the weights validation scores and final/ exports (registered: resumed with the run)
    average = start_average(accelerator, model, cfg.ema_decay)
    # --early_stopping_patience: the run ends when validation stops improving; final/ holds the best one's weights
    stopper = start_early_stopping(accelerator, cfg, run.ckpt, {"model": model}, data.summary.get("hours"))

    # ---- resume, or start: global feature statistics (BEST-RQ's, or computed once and broadcast) --
    # What the run is made of: a resume refuses another config (but for the fields that may change on
    # resume) or other training data.
    parts = dict(models=model, optimizers=optimizer, schedulers=scheduler)  # what a checkpoint holds
    state = TrainState.for_run(cfg, accelerator.num_processes, accumulation, data=data.summary)
    if resume_from_checkpoint(accelerator, run.ckpt, state, **parts) is None and not models["model"].stats_given:
        logmel = LogMel(cfg.sample_rate, cfg.n_mels)  # evenly spaced rows: a manifest is sorted by speaker
        set_feature_stats(accelerator, model, lambda: feature_stats(  # (id, (frames, n_mels)) pairs
            (row["id"], logmel(load_wav(row, cfg.sample_rate))) for row in data.sample_rows(cfg.stats_utterances)))
    metrics = start_logging(run, state)  # config.yaml, metrics.jsonl and trackers from state.step on
    scorer = Scorer()

    # ---- training loop ----------------------------------------------------------------------
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    throughput = Throughput(accelerator, data.durations)  # audio s/s
    window = WindowMeans()  # mean CTC loss over the accumulation window
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
        # Frozen encoder: every parameter still gets its (DDP-reduced) gradient, so the DDP reducer
        # sees the same graph every step; we drop the encoder's before the update, and AdamW skips
        # parameters without a gradient (no step, no decay, no moments).
        if state.step < cfg.freeze_encoder_steps:
            for p in encoder_params:
                p.grad = None
        grad_norm = optimizer_update(accelerator, model, optimizer, state, max_grad_norm=cfg.max_grad_norm,
                                     max_nonfinite_updates=cfg.max_nonfinite_updates)
        end_step(state, scheduler)
        if average is not None:
            average.update(accelerator.unwrap_model(model))
        bar.update(1)

        row = {}
        if validation_due(state, cfg.eval_steps, cfg.max_steps):  # every eval_steps, and at the end
            with swapped_in(average, model):
                row, decoded = evaluate(model, valid_loader, accelerator, tokenizer, scorer)  # collective
                stopper.after_validation(state, row)  # collective; keeps these (averaged) weights if the best
            logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
            if accelerator.is_main_process and "tensorboard" in trackers(cfg.report_to):  # hypotheses beside references
                accelerator.get_tracker("tensorboard", unwrap=True).add_text("eval/decoded", "\n\n".join(
                    f"`{i}`  \nref: {ref}  \nhyp: {hyp}" for i, hyp, ref in decoded[:4]), state.step)
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            row = metrics.log_step(state, window, throughput, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm,
                                   extra=row)  # collective
            bar.set_postfix(audio_s_per_s=f"{row['audio_s_per_s']:.0f}", loss=f"{row['loss']:.3f}")
        window.zero()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: everything needed to transcribe; final/ appears complete or not at all ------
    def write_extras(folder: Path) -> None:  # main process: final/ as a transformers model, plus ours
        save_config(cfg, folder / "config.yaml")
        shutil.copytree(tok_dir, folder / "tokenizer", ignore=shutil.ignore_patterns(".complete"))
        frontend = None
        if cfg.encoder_type != "conformer":  # what decode.py and export.py build the model from
            shutil.copytree(out / "frontend", folder / "frontend", ignore=shutil.ignore_patterns(".complete"))
            frontend = json.loads((out / "frontend" / "frontend.json").read_text())
        export_hf(folder, load_file(folder / "model.safetensors"), cfg, tokenizer, frontend)
        write_model_card(folder, recipe=Path(__file__).parent.name, state=state, data_dir=data.data_dir, metrics_path=out / "metrics.jsonl",
                         ended=stopper.card_line(state.step), usage=f"""
            ```python
            from transformers import pipeline

            asr = pipeline("automatic-speech-recognition", model="<this folder>"{"" if frontend else ", trust_remote_code=True"})
            asr({{"raw": samples, "sampling_rate": {cfg.sample_rate}}})["text"]
            ```""")

    with swapped_in(average, model), stopper.kept_weights():  # final/ holds the average (the best validation's)
        export_final(accelerator, model, out, write_extras)  # collective
    accelerator.end_training()

if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
