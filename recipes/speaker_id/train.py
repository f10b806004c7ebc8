"""Speaker identification (utterance-level cross-entropy over the training speakers) with the shared
Conformer encoder, with Hugging Face Accelerate. Made by copying recipes/best_rq (docs/adapt.md).

    # built-in espeak-ng corpus: its 40 training voices, 1 process (CPU or one GPU)
    accelerate launch recipes/speaker_id/train.py
    # 2 real DDP processes on a CPU-only machine
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/speaker_id/train.py

Re-running the same command with the same --output_dir resumes from the newest complete checkpoint
and ends bit-identical to a run that was never interrupted (on CPU; see README "Resume").
Outputs: <output_dir>/final/{model.safetensors, config.yaml, speakers.json, encoder/} (encoder/: a
transformers folder, AutoModel + AutoFeatureExtractor), <output_dir>/metrics.jsonl. Then, who speaks:

    python recipes/speaker_id/predict.py --checkpoint outputs/speaker_id --audio a.wav b.flac

Adapting it: the data (data.py), the model and its loss (model.py), what is logged and evaluated are
yours to change; the seams above `main` (build_data, build_models, build_optimizers, compute_loss: README.md,
"Adapt a recipe") are what the benchmarks and tests build the recipe with. The loop's calls into common/training/loop.py carry the exact-resume
and DDP guarantees (docs/resume.md); they check their own order (a bypassed or misplaced one stops the
run with a ContractError saying which), and tests/guarantees/test_contract.py checks that every recipe calls them.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import DatasetConfig, exit_on_signals_during_start_up, parse_config
from common.config_rules import Count, Names, Range


@dataclass
class Config(DatasetConfig):
    """Speaker identification. Every field can be set in the YAML (--config) or as --key value; the
    shared ones (run, data and a `datasets` source, optimization, logging) and their rules are
    RunConfig's and DatasetConfig's (common/config.py)."""

    # RunConfig's settings with this recipe's defaults
    output_dir: str = "outputs/speaker_id"
    metric_for_best_model: Literal["eval_acc", "eval_loss"] = "eval_acc"
    max_steps: int = 300
    # --- data ---
    train_split: Annotated[str, Names] = "train"  # subfolder(s) of data_dir, comma-separated: the training voices' utterances
    heldout_fraction: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] = 0.1  # of train_split's utterances held out for validation, chosen by a hash of their ids
    speaker_column_name: str = "speaker"  # --dataset_name: its speaker label column (the validation split's speakers must be training speakers)
    FOLDER_ONLY = dict.fromkeys(("train_split", "heldout_fraction"), "--eval_split_name validates (held-out "
                                "utterances of the training speakers)")
    READS_TEXT = False
    EXTRA_COLUMNS = ("speaker",)  # a row's `speaker`: a folder manifest's column, a source's --speaker_column_name
    n_mels: Annotated[int, Count] = 80  # log-mel bins, 25 ms window, 10 ms hop
    stack_frames: Annotated[int, Count] = 4  # 10 ms frames stacked per encoder frame (4 → 40 ms)
    # --- encoder (Conformer, transformers Wav2Vec2BertModel) ---
    hidden_size: Annotated[int, Count] = 96
    num_layers: Annotated[int, Count] = 2
    num_heads: Annotated[int, Count] = 4
    ffn_dim: Annotated[int, Count] = 384
    conv_kernel: Annotated[int, Count] = 15  # depthwise convolution kernel, in 40 ms frames
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.1  # residual branches and input projection
    attention_dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.0  # on attention probabilities (0 here and below, as in best_rq: the costly dropouts on CPU; benchmarks/README.md)
    activation_dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.0  # on feed-forward activations

# The test model: what tests/ and benchmarks/ add to this recipe's config.yaml to train it in seconds on
# the tiny built-in corpus (a copy keeps its own: docs/adapt.md, "How the tests pick up the copy").
TEST_TINY = ["--hidden_size", "32", "--num_layers", "1", "--num_heads", "2", "--ffn_dim", "64", "--conv_kernel", "7",
             "--heldout_fraction", "0.25"]

if __name__ == "__main__":  # --help and config mistakes are answered before the slow imports below
    exit_on_signals_during_start_up()  # a Ctrl-C during the imports: one line, not a traceback
    CONFIG = parse_config(Config, default_yaml=Path(__file__).with_name("config.yaml"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from common.training.checkpoint import export_final  # noqa: E402
from common.training.resume import resume_from_checkpoint  # noqa: E402
from common.training.state import TrainState  # noqa: E402
from common.training.early_stopping import start_early_stopping  # noqa: E402
from common.config import save_config  # noqa: E402
from common.training.distributed import check_fsdp_wrap  # noqa: E402
from common.model.encoder import encoder_config_from  # noqa: E402
from common.training.faults import run_main  # noqa: E402
from common.model.features import feature_stats, set_feature_stats  # noqa: E402
from common.model.hf_export import save_feature_extractor, write_model_card  # noqa: E402
from common.training.logs import Throughput, WindowMeans, get_logger, progress_bar  # noqa: E402
from common.training.loop import (adamw_scheduled, decay_groups, no_sync_unless,  # noqa: E402
                         optimizer_update, end_step, save_or_preempt, train_batches, validation_due)
from common.training.run import start_logging, start_run  # noqa: E402
from common.training.faults import UsageError  # noqa: E402
from common.data.source import RecipeData, Source  # noqa: E402
from tools.corpus import resolve_data_dir  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from data import FeatureDataset, PaddingCollator, held_out  # noqa: E402
from model import SpeakerClassifier, evaluate  # noqa: E402

logger = get_logger(__name__)


# ---- the recipe's seams: main below, the benchmarks and the tests build the recipe through these ---

def carve(rows, fraction: float) -> dict:
    """A folder's training utterances split into "train" and "validation" (held out: `held_out` of
    their ids): validation holds unseen utterances of the training voices."""
    out = [held_out(i, fraction) for i in rows["id"]]
    return {"train": rows.select([i for i, o in enumerate(out) if not o]),
            "validation": rows.select([i for i, o in enumerate(out) if o])}


def build_data(cfg: Config, accelerator, out: Path, *, global_batch: int, num_workers: int) -> RecipeData:
    """Log-mel items with their speaker and the padding collator on the source (common/data/source.py): a
    LibriSpeech-layout folder's train_split, heldout_fraction of it held out, or --dataset_name's
    splits with --speaker_column_name. The speakers are the training split's, sorted."""
    source = Source.open(cfg, accelerator, out, global_batch=global_batch, num_workers=num_workers,
                         corpus=lambda: resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "librispeech"),
                         splits=lambda data_dir, check: carve(check("train", cfg.train_split), cfg.heldout_fraction))
    speakers = sorted({str(s) for s in source.column("train", "speaker")[1]})
    if len(speakers) < 2:  # e.g. an audiofolder without a speaker column: every row is its folder's voice
        raise UsageError(f"the training split has {len(speakers)} speaker ({', '.join(speakers)}): identification needs "
                         f"two or more; name each utterance's in a speaker column (an audiofolder's metadata.csv: "
                         f"speaker or speaker_id)")
    known, (ids, found) = set(speakers), source.column("validation", "speaker")
    unseen = [(i, s) for i, s in zip(ids, found) if str(s) not in known]
    if unseen:
        raise UsageError(f"{len(unseen)} validation utterances are of speakers the training split lacks, e.g. "
                         f"{unseen[0][0]} (speaker {unseen[0][1]}): validate on held-out utterances of the "
                         f"training voices (--eval_split_name)")
    if not source.size("validation"):
        raise UsageError(f"no utterance held out (--heldout_fraction {cfg.heldout_fraction} of "
                         f"{source.size('train')}): raise --heldout_fraction")
    items = lambda rows: FeatureDataset(rows, cfg.sample_rate, cfg.n_mels, speakers)  # noqa: E731
    collator = PaddingCollator(cfg)
    return source.loaders(train=(items, collator), valid=(items, collator))


def build_models(cfg: Config, data: RecipeData) -> dict[str, SpeakerClassifier]:
    """The classifier, sized by the training speakers (`data.train_items.speakers`)."""
    return {"model": SpeakerClassifier(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                                       num_speakers=len(data.train_items.speakers))}


def build_optimizers(cfg: Config, models: dict) -> tuple[dict, dict]:
    """AdamW (no decay on biases and norms) and its schedule, sized in optimizer steps."""
    return adamw_scheduled(cfg, decay_groups(models["model"], cfg.weight_decay))


def compute_loss(models: dict, batch: dict, cfg: Config, step: int) -> tuple[dict, dict]:
    """Utterance-level cross-entropy over the speakers, and (logged) the accuracy."""
    loss, acc, *_ = models["model"](batch["feats"], batch["feat_lens"], batch["speakers"])
    return {"model": loss}, {"loss": loss, "acc": acc}


def main(cfg: Config) -> None:
    # ---- start: accelerator, output_dir, signals, seed, and where to resume (common/training/run.py) ----
    # The checkpoint is chosen before the data: its global batch sizes the training batches
    # (run.global_batch), and resume_from_checkpoint restores it after accelerator.prepare.
    run = start_run(cfg, recipe=Path(__file__).parent.name)
    accelerator, out, cfg, accumulation, preemption = run.accelerator, run.out, run.cfg, run.accumulation, run.preemption

    # ---- data, model, optimizer (the seams above) ---------------------------------------------
    data = build_data(cfg, accelerator, out, global_batch=run.global_batch, num_workers=run.num_workers)
    data.resumes = run.ckpt is not None  # what build_models reads: a resume loads its checkpoint over the models
    models = build_models(cfg, data)
    model = models["model"]
    logger.info(f"encoder: {sum(p.numel() for p in model.encoder.parameters()) / 1e6:.2f} M parameters")
    optimizers, schedulers = build_optimizers(cfg, models)
    optimizer, scheduler = optimizers["model"], schedulers["model"]
    # The scheduler is not prepared: it steps once per optimizer step in end_step (accelerate #1382).
    check_fsdp_wrap(accelerator, model)  # FSDP: the profile's shard unit must exist in this model
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, data.train_loader, data.valid_loader)

    # ---- resume, or start: global feature statistics (computed once, broadcast, checkpointed) --
    # What the run is made of: a resume refuses another config (but for the fields that may change on
    # resume) or other training data.
    parts = dict(models=model, optimizers=optimizer, schedulers=scheduler)  # what a checkpoint holds
    # --early_stopping_patience: the run ends when validation stops improving; final/ holds the best one's weights
    stopper = start_early_stopping(accelerator, cfg, run.ckpt, {"model": model}, data.summary.get("hours"))
    state = TrainState.for_run(cfg, accelerator.num_processes, accumulation, data=data.summary)
    if resume_from_checkpoint(accelerator, run.ckpt, state, **parts) is None:  # evenly spaced rows: a manifest is sorted by speaker
        set_feature_stats(accelerator, model, lambda: feature_stats(  # (id, (frames, n_mels), speaker) items
            data.train_items.item(row) for row in data.sample_rows(cfg.stats_utterances)))
    metrics = start_logging(run, state)  # config.yaml, metrics.jsonl and trackers from state.step on

    # ---- training loop ----------------------------------------------------------------------
    speakers = data.train_items.speakers
    logger.info(f"{len(speakers)} speakers; chance level: accuracy {1 / len(speakers):.3f}, loss ln({len(speakers)}) "
                f"= {math.log(len(speakers)):.3f}")
    preemption.defer()  # from here on a signal means: save at the next step boundary, exit 75
    model.train()
    bar = progress_bar(accelerator, cfg.max_steps, state.step)
    throughput = Throughput(accelerator, data.durations)  # audio s/s
    window = WindowMeans()  # loss, accuracy: means over the accumulation window
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
        bar.update(1)

        row = {}
        if validation_due(state, cfg.eval_steps, cfg.max_steps):  # every eval_steps, and at the end
            row = evaluate(model, valid_loader, accelerator)  # collective
            stopper.after_validation(state, row)  # collective; keeps these weights if the best
            logger.info(f"step {state.step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        if row or state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
            row = metrics.log_step(state, window, throughput, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm,
                                   extra=row)  # collective
            bar.set_postfix(audio_s_per_s=f"{row['audio_s_per_s']:.0f}", loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}")
        window.zero()
        save_or_preempt(accelerator, out, state, preemption, **parts, save_steps=cfg.save_steps,
                        max_steps=cfg.max_steps, save_total_limit=cfg.save_total_limit)  # collective
    bar.close()

    # ---- export: final/ appears complete or not at all -------------------------------------
    def write_extras(folder: Path) -> None:  # main process, beside model.safetensors (head, stats)
        save_config(cfg, folder / "config.yaml")
        (folder / "speakers.json").write_text(json.dumps(speakers))  # the head's outputs, in order
        weights = load_file(folder / "model.safetensors")  # the full weights, also when training was sharded
        # encoder/: a transformers folder (AutoModel + AutoFeatureExtractor with our statistics)
        accelerator.unwrap_model(model).encoder.save_pretrained(
            folder / "encoder", state_dict={k[len("encoder."):]: v for k, v in weights.items() if k.startswith("encoder.")})
        save_feature_extractor(folder / "encoder", n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                               sample_rate=cfg.sample_rate, mean=weights["feat_mean"], std=weights["feat_std"])
        write_model_card(folder, recipe=Path(__file__).parent.name, state=state, data_dir=data.data_dir, metrics_path=out / "metrics.jsonl",
                         ended=stopper.card_line(state.step),
                         usage=f"""
            `encoder/` is a transformers folder:

            ```python
            from transformers import AutoFeatureExtractor, AutoModel

            fe = AutoFeatureExtractor.from_pretrained("<this folder>/encoder", trust_remote_code=True)
            encoder = AutoModel.from_pretrained("<this folder>/encoder")
            hidden = encoder(**fe(samples, sampling_rate=16000, return_tensors="pt")).last_hidden_state
            ```

            `speakers.json` names the classifier's outputs (`head.*` in `model.safetensors`) in order.
            The whole classifier (encoder, head, speakers), from a checkout of speech-recipes:
            `python recipes/{Path(__file__).parent.name}/predict.py --checkpoint <this folder> --audio a.wav b.flac`
            prints the most probable speaker of each file and its probability.""")

    with stopper.kept_weights():  # with early stopping on: the best validation's weights
        export_final(accelerator, model, out, write_extras)  # collective
    accelerator.end_training()

if __name__ == "__main__":
    run_main(lambda: main(CONFIG))
