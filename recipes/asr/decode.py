"""Transcribe a split with a trained Conformer-CTC and score it: WER and CER (corpus level).

    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr --split test
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr/final --split test --decoding beam
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml recipes/asr/decode.py \
        --checkpoint outputs/asr --split test
    # a real LibriSpeech folder
    accelerate launch recipes/asr/decode.py --checkpoint outputs/asr_100h --data_dir /data/LibriSpeech \
        --split test-clean

--checkpoint is a training output_dir (its final/ is used), a final/ folder, or a
checkpoints/step_XXXXXXXX/ folder. Data settings (data_dir, built-in corpus, front end) come from the
checkpoint's config.yaml unless given here. Writes <output>/<split>-<decoding>.jsonl, one
{"id", "ref", "hyp"} per utterance sorted by id, and <output>/<split>-<decoding>.json with the
scores; <output> defaults to <output_dir>/decode/<checkpoint name>/ (e.g. outputs/asr/decode/final/):
beside the checkpoint, never inside it (final/ and step folders are sealed by their digests); prints WER and CER. In N processes each process decodes its share and the main process
scores the gathered results, each utterance exactly once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal
from types import SimpleNamespace

import yaml

from common.checkpoint import resolve_checkpoint
from common.config import Count, ExistingPath, NonNegative, Positive, parse_config
from common.data import make_loader
from common.distributed import build_accelerator
from common.encoder import encoder_config_from
from common.hf_export import load_recipe_ctc_weights
from common.logs import get_logger
from tools.corpus import resolve_data_dir

# recipe-local modules (this folder is on sys.path)
from ctc_decode import transcribe
from data import SpecAugmentCollator, SpeechDataset, read_split
from model import ConformerCTC
from scoring import Scorer, gather_results
from text import check_transcripts, load_tokenizer

logger = get_logger(__name__)


@dataclass
class EvalConfig:
    """Decode and score a split. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/asr"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    split: str = "test"  # subfolder(s) of data_dir, comma-separated
    data_dir: Annotated[str | None, ExistingPath] = None  # None: the checkpoint's data_dir (or its built-in corpus)
    data_cache_dir: str | None = None  # None: the checkpoint's
    output: str | None = None  # folder for hypotheses and scores; None = <output_dir>/decode/<checkpoint name>
    decoding: Literal["greedy", "beam"] = "greedy"  # beam: CTC prefix beam search
    beam_size: Annotated[int, Count] = 8  # prefixes kept by beam search
    max_batch_seconds: Annotated[float, Positive] = 120.0  # padded seconds of audio per batch, per process
    num_workers: Annotated[int, NonNegative] = 0  # DataLoader workers per process


def main():
    args = parse_config(EvalConfig)
    folder = resolve_checkpoint(args.checkpoint)
    cfg = SimpleNamespace(**yaml.safe_load((folder / "config.yaml").read_text()))  # the training run's config
    accelerator = build_accelerator(mixed_precision="no")
    world = accelerator.num_processes

    # final/ holds its tokenizer; a checkpoints/step_X/ folder uses its run's <output_dir>/tokenizer.
    tok_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder.parent.parent / "tokenizer"
    tokenizer = load_tokenizer(tok_dir)
    data_dir = args.data_dir or resolve_data_dir(cfg.data_dir, args.data_cache_dir or cfg.data_cache_dir,
                                                 cfg.builtin_corpus, "librispeech")
    manifest = read_split(data_dir, args.split)
    # characters the model cannot emit: refused unless the run said --unknown_chars drop
    try:
        check_transcripts(manifest["id"], manifest["text"], tokenizer, args.split, getattr(cfg, "unknown_chars", "error"))
    except ValueError as e:
        raise SystemExit(f"decode.py: {e}") from None
    loader, _ = make_loader(SpeechDataset(manifest, cfg, tokenizer), manifest["duration"],
                            SpecAugmentCollator(cfg, augment=False), max_batch_seconds=args.max_batch_seconds,
                            num_buckets=cfg.num_buckets, seed=cfg.seed, multiple_of=world, shuffle=False,
                            num_workers=args.num_workers)

    model = ConformerCTC(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                         vocab_size=tokenizer.vocab_size)
    model.load_state_dict(load_recipe_ctc_weights(folder))  # weights and feature statistics
    model.to(accelerator.device)
    loader = accelerator.prepare(loader)  # shards the batches over processes (no DDP wrapper needed)

    start = time.monotonic()
    results, loss_sum, tokens = transcribe(model, loader, tokenizer, args.decoding, args.beam_size)
    results = gather_results(results)  # collective: every utterance once, sorted by id
    if accelerator.is_main_process:
        if len(results) != len(manifest):
            raise RuntimeError(f"scored {len(results)} utterances, the split has {len(manifest)}")
        scores = Scorer()([h for _, h, _ in results], [r for _, _, r in results])
        summary = {"checkpoint": str(folder), "split": args.split, "data_dir": data_dir, "decoding": args.decoding,
                   "beam_size": args.beam_size if args.decoding == "beam" else None, "utterances": len(results),
                   **scores, "processes": world, "decode_seconds": round(time.monotonic() - start, 2)}
        # Beside the checkpoint, never inside: final/ and checkpoints/step_X/ are sealed (COMPLETE digests).
        run_dir = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
        out = Path(args.output) if args.output else run_dir / "decode" / folder.name
        out.mkdir(parents=True, exist_ok=True)
        name = f"{args.split.replace(',', '+')}-{args.decoding}"
        with open(out / f"{name}.jsonl", "w") as f:
            for utt_id, hyp, ref in results:
                f.write(json.dumps({"id": utt_id, "ref": ref, "hyp": hyp}) + "\n")
        (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"{args.split} ({len(results)} utterances, {args.decoding}): "
              f"WER {100 * scores['wer']:.2f}%  CER {100 * scores['cer']:.2f}%  → {out / name}.jsonl", flush=True)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
