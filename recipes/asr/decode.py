"""Transcribe a split with a trained Conformer-CTC and score it: WER and CER (corpus level).

    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr --split test
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr/final --split test --decoding beam
    # with a word n-gram LM (python recipes/asr/lm.py ... --output_dir outputs/asr/lm), alpha and beta
    # chosen on the checkpoint's validation split
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr --split test --lm outputs/asr/lm --tune_lm
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/asr/decode.py \
        --checkpoint outputs/asr --split test
    # a real LibriSpeech folder
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr_100h --data_dir /data/LibriSpeech \
        --split test-clean

--checkpoint is a training output_dir (its final/ is used), a final/ folder, or a
checkpoints/step_XXXXXXXX/ folder. Data settings (data_dir, built-in corpus, front end) come from the
checkpoint's config.yaml unless given here; a run trained on --dataset_name decodes that source's
--split (loaded whole, map-style, also when it was trained --streaming), with its column names. Writes <output>/<split>-<decoding>.jsonl, one
{"id", "ref", "hyp"} per utterance sorted by id, and <output>/<split>-<decoding>.json with the
scores, and <output>/<split>-<decoding>.html, a page to read and listen to (tools/report.py: per
utterance its audio, the errors marked, WER and CER, sortable; the run's training curves); <output> defaults to <output_dir>/decode/<checkpoint name>/ (e.g. outputs/asr/decode/final/):
beside the checkpoint, never inside it (final/ and step folders are sealed by their digests); prints WER and CER. In N processes each process decodes its share and the main process
scores the gathered results, each utterance exactly once.

--lm (a folder from lm.py, a final/language_model/, or an .arpa file) is checked before kenlm reads it
(the folder against its COMPLETE marker, or its export's; a bare file must be a regular file), then
decodes with pyctcdecode's beam search and the LM (shallow fusion, `--beam_width` hypotheses) and,
from the same log-posteriors, greedily: <name> is <split>-lm and its .json holds both scores (`wer`, `cer` with the LM;
`wer_no_lm`, `cer_no_lm` greedy). `--tune_lm` first decodes the validation split (the checkpoint's
valid_split, never the test split) for every --lm_alphas × --lm_betas pair and keeps the pair with the
lowest WER (ties: the first); otherwise --lm_alpha/--lm_beta, or the LM folder's attrs.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, NoReturn
import dataclasses

from accelerate.utils import broadcast_object_list

import soundfile as sf
import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.training.sealing import resolve_checkpoint, run_dir_of
from common.config import load_config, parse_config
from common.config_rules import ConfigError, Count, ExistingPath, Names, NonNegative, Positive
from common.data.loading import make_loader
from common.training.distributed import build_accelerator
from common.training.faults import RunError, UsageError, run_main
from common.training.logs import get_logger
from common.data.source import load_split
from tools.corpus import resolve_data_dir

# recipe-local modules (this folder is on sys.path)
from ctc_decode import LmError, ctc_greedy, lm_decode, load_lm_decoder, posteriors, transcribe
from data import PaddingCollator, SpecAugmentCollator, SpeechDataset, load_wav, read_split, transcribed
from model import checkpoint_frontend, ctc_model, recipe_weights
from scoring import Scorer, gather_results
from text import check_transcripts, checkpoint_tokenizer
from train import Config

logger = get_logger(__name__)


@dataclass
class EvalConfig:
    """Decode and score a split. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/asr"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    split: Annotated[str, Names] = "test"  # subfolder(s) of data_dir, comma-separated
    data_dir: Annotated[str | None, ExistingPath] = None  # None: the checkpoint's data_dir (or its built-in corpus)
    dataset_name: str | None = None  # a `datasets` source (common/data/source.py) to decode instead; None: the checkpoint's, if it trained on one
    data_cache_dir: str | None = None  # None: the checkpoint's
    output: str | None = None  # folder for hypotheses and scores; None = <output_dir>/decode/<checkpoint name>
    decoding: Literal["greedy", "beam"] = "greedy"  # beam: CTC prefix beam search
    beam_size: Annotated[int, Count] = 8  # prefixes kept by beam search
    max_batch_seconds: Annotated[float, Positive] = 120.0  # padded seconds of audio per batch, per process
    num_workers: Annotated[int, NonNegative] = 0  # DataLoader workers per process
    lm: Annotated[str | None, ExistingPath] = None  # word n-gram LM: lm.py's folder, final/language_model/ or an .arpa; None: no LM
    beam_width: Annotated[int, Count] = 100  # hypotheses kept by the LM beam search (pyctcdecode's default, as the pipeline)
    lm_alpha: float | None = None  # weight of the LM's natural-log probability; None: the LM folder's attrs.json
    lm_beta: float | None = None  # score bonus per word; None: the LM folder's attrs.json
    tune_lm: bool = False  # choose lm_alpha, lm_beta on the validation split (grid below)
    lm_alphas: list[Annotated[float, NonNegative]] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.5])  # --tune_lm grid of lm_alpha
    lm_betas: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0, 2.0, 3.0])  # --tune_lm grid of lm_beta (a negative one penalizes words)


def refuse(message: str) -> NoReturn:
    """A decoding setting that cannot work: one line (the first process of each machine), exit code 2."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def html_report(report: Path, summary: dict, results: list[tuple[str, str, str]], manifest, sample_rate: int,
                run_dir: Path) -> None:
    """<split>-<decoding>.html (tools/report.py): the summary, the run's training curves, and per
    utterance its audio (linked beside the page from the data folder, or written as WAV from a
    `datasets` source's arrays), the reference against the hypothesis with the errors marked, WER, CER."""
    from tools.report import command_line, error_rates, files_dir, place, training_curves, write_report

    index = {utt_id: n for n, utt_id in enumerate(manifest["id"])}
    rows = []
    for n, (utt_id, hyp, ref) in enumerate(results):
        item = manifest[index[utt_id]]
        name = f"audio/{n:06d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', utt_id)}"  # ids of a `datasets` source may hold '/'
        if isinstance(item.get("path"), str) and Path(item["path"]).is_file():
            audio = place(item["path"], report, name + Path(item["path"]).suffix)
        else:  # audio held in the source (arrays or bytes): written once as 16-bit WAV
            (files_dir(report) / "audio").mkdir(parents=True, exist_ok=True)
            sf.write(files_dir(report) / f"{name}.wav", load_wav(item, sample_rate).numpy(), sample_rate, subtype="PCM_16")
            audio = f"{files_dir(report).name}/{name}.wav"
        rows.append({"id": utt_id, "audio": audio, "ref": ref, "hyp": hyp, **error_rates(ref, hyp)})
    curves = training_curves(run_dir / "metrics.jsonl", report)
    write_report(report, f"ASR: {summary['split']}, {summary['decoding']} decoding", summary,
                 [("id", "id", "text"), ("audio", "audio", "audio"), ("edits", "reference → hypothesis", "edits"),
                  ("wer", "WER", "pct"), ("cer", "CER", "pct")], rows, command_line(),
                 [("training curves", curves)] if curves else [], sort="wer")


def main():
    args = parse_config(EvalConfig)
    try:  # verified (COMPLETE digests) before any of its files is read
        folder = resolve_checkpoint(args.checkpoint)
        cfg = load_config(folder, Config)  # the training run's config
        tokenizer = checkpoint_tokenizer(folder)
        frontend = checkpoint_frontend(folder, cfg)  # a transformers encoder's feature extractor, or None: log-mel
    except (UsageError, ConfigError) as e:
        refuse(str(e))
    accelerator = build_accelerator(mixed_precision="no")
    world = accelerator.num_processes

    if args.data_dir and args.dataset_name:
        refuse("--dataset_name and --data_dir both name the data to decode: give one")
    source = None if args.data_dir else (args.dataset_name or cfg.dataset_name)
    if source:  # the checkpoint's column names and configuration
        source = dataclasses.replace(cfg, dataset_name=source)
        data_dir = source.dataset_name
    else:
        data_dir = args.data_dir or resolve_data_dir(cfg.data_dir, args.data_cache_dir or cfg.data_cache_dir,
                                                     cfg.builtin_corpus, "librispeech")
    grid = (list(args.lm_alphas), list(args.lm_betas))  # numbers, checked by parse_config
    if not args.lm and (args.tune_lm or args.lm_alpha is not None or args.lm_beta is not None):
        refuse("--tune_lm, --lm_alpha and --lm_beta set the LM decoding; give the LM with --lm DIR")
    if args.lm and args.decoding != "greedy":
        refuse("--lm decodes with the LM beam search (--beam_width); drop --decoding beam")
    if args.tune_lm and (args.lm_alpha is not None or args.lm_beta is not None):
        refuse("--tune_lm chooses lm_alpha and lm_beta; drop --lm_alpha/--lm_beta, or --tune_lm")
    try:
        decoder = load_lm_decoder(args.lm, tokenizer, args.lm_alpha, args.lm_beta) if args.lm else None
    except LmError as e:
        refuse(f"--lm {e}")

    def loader_for(split):
        if source:
            try:
                with accelerator.main_process_first():  # `datasets` builds its cache once
                    manifest = transcribed(load_split(source, split)[0], split)
            except RunError as e:  # a split or column the source does not have
                refuse(str(e))
        else:
            manifest = read_split(data_dir, split)
        # characters the model cannot emit: refused unless the run said --unknown_chars drop
        try:
            check_transcripts(manifest["id"], manifest["text"], tokenizer, split, cfg.unknown_chars)
        except ValueError as e:
            raise SystemExit(f"decode.py: {e}") from None
        loader, _ = make_loader(SpeechDataset(manifest, cfg, tokenizer, frontend=frontend), manifest["duration"],
                                PaddingCollator() if frontend else SpecAugmentCollator(cfg, augment=False), max_batch_seconds=args.max_batch_seconds,
                                num_buckets=cfg.num_buckets, seed=cfg.seed, multiple_of=world, shuffle=False,
                                num_workers=args.num_workers)
        return manifest, accelerator.prepare(loader)  # shards the batches over processes (no DDP wrapper needed)

    model = ctc_model(cfg, tokenizer.vocab_size, frontend)
    try:
        model.load_state_dict(recipe_weights(folder, cfg))  # weights and feature statistics
    except Exception as e:  # noqa: BLE001 — sealed, yet not this config's model (SafetensorError, a shape, a key)
        refuse(f"--checkpoint {folder}: its weights do not load into the model its config.yaml describes "
               f"({type(e).__name__}: {str(e).splitlines()[0][:300]}): re-run the training command that made it")
    model.to(accelerator.device)
    scorer = Scorer()

    if args.tune_lm:  # on the validation split: the test split never chooses a setting
        _, valid_loader = loader_for(cfg.eval_split_name if source else cfg.valid_split)
        valid = posteriors(model, valid_loader)
        best = None
        for alpha in grid[0]:
            for beta in grid[1]:
                decoder.reset_params(alpha=alpha, beta=beta)
                hyps = gather_results([(i, lm_decode(decoder, lp, args.beam_width), r) for i, r, lp in valid])  # collective
                if accelerator.is_main_process:
                    wer = scorer([h for _, h, _ in hyps], [r for _, _, r in hyps])["wer"]
                    logger.info(f"{cfg.valid_split}: alpha {alpha} beta {beta}: WER {100 * wer:.2f}%")
                    best = min(best or (wer, alpha, beta), (wer, alpha, beta), key=lambda t: t[0])
        best = broadcast_object_list([best])[0]  # the main process's choice, on every process
        args.lm_alpha, args.lm_beta = best[1], best[2]
        decoder.reset_params(alpha=args.lm_alpha, beta=args.lm_beta)

    manifest, loader = loader_for(args.split)
    start = time.monotonic()
    if decoder is None:
        results, _, _ = transcribe(model, loader, tokenizer, args.decoding, args.beam_size)
    else:  # LM beam search, and greedy on the same log-posteriors for the comparison
        decoded = [(i, lm_decode(decoder, lp, args.beam_width), r, tokenizer.decode(ctc_greedy(torch.from_numpy(lp))))
                   for i, r, lp in posteriors(model, loader)]
        greedy = gather_results([(i, g, r) for i, _, r, g in decoded])  # collective
        results = [(i, h, r) for i, h, r, _ in decoded]
    results = gather_results(results)  # collective: every utterance once, sorted by id
    if accelerator.is_main_process:
        if len(results) != len(manifest):
            raise RuntimeError(f"scored {len(results)} utterances, the split has {len(manifest)}")
        scores = scorer([h for _, h, _ in results], [r for _, _, r in results])
        decoding = "lm" if decoder else args.decoding
        summary = {"checkpoint": str(folder), "split": args.split, "data_dir": data_dir, "decoding": decoding,
                   "beam_size": args.beam_size if decoding == "beam" else None, "utterances": len(results), **scores}
        if decoder:
            no_lm = scorer([h for _, h, _ in greedy], [r for _, _, r in greedy])
            summary.update(wer_no_lm=no_lm["wer"], cer_no_lm=no_lm["cer"], lm=str(args.lm), beam_width=args.beam_width,
                           lm_alpha=decoder._language_model.alpha,
                           lm_beta=decoder._language_model.beta, tuned_on=cfg.valid_split if args.tune_lm else None)
        summary.update(processes=world, decode_seconds=round(time.monotonic() - start, 2))
        out = Path(args.output) if args.output else run_dir_of(folder) / "decode" / folder.name  # beside, never inside
        out.mkdir(parents=True, exist_ok=True)
        name = f"{args.split.replace(',', '+')}-{decoding}"
        with open(out / f"{name}.jsonl", "w") as f:
            for utt_id, hyp, ref in results:
                f.write(json.dumps({"id": utt_id, "ref": ref, "hyp": hyp}) + "\n")
        (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        html_report(out / f"{name}.html", summary, results, manifest, cfg.sample_rate, run_dir_of(folder))
        print(f"{args.split} ({len(results)} utterances, {decoding}): "
              f"WER {100 * scores['wer']:.2f}%  CER {100 * scores['cer']:.2f}%  → {out / name}.jsonl", flush=True)
        if decoder:
            print(f"{args.split} without the LM (greedy): WER {100 * summary['wer_no_lm']:.2f}%  "
                  f"CER {100 * summary['cer_no_lm']:.2f}%; LM alpha {summary['lm_alpha']} beta {summary['lm_beta']}", flush=True)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_main(main)  # its exit skips the last garbage collection (seconds): common.training.faults
