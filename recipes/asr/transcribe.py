"""Transcribe audio files with a trained Conformer-CTC: one `path<TAB>transcript` line per file.

    python recipes/asr/transcribe.py --checkpoint outputs/asr --audio speech.wav other.flac
    python recipes/asr/transcribe.py --checkpoint outputs/asr/final --audio recordings/*.wav --decoding beam
    # with a word n-gram LM (python recipes/asr/lm.py ... --output_dir outputs/asr/lm)
    python recipes/asr/transcribe.py --checkpoint outputs/asr --lm outputs/asr/lm --audio speech.wav
    python recipes/asr/transcribe.py --checkpoint outputs/asr --audio *.flac --output transcripts.jsonl

--checkpoint is a training output_dir (its final/), a final/ folder, or a checkpoints/step_XXXXXXXX/
folder, verified against its COMPLETE digests before it is read (as decode.py). --audio takes the
files as separate arguments up to the next --flag (a shell glob works). Each is read with soundfile,
mixed down to mono and resampled to the model's sample_rate as the training data were
(common.data.loading.load_audio); a file that cannot be read is refused in one line before any file
is decoded. Decoding is decode.py's (greedy, --decoding beam, or --lm with pyctcdecode's beam
search), one file at a time in this process; to score a whole split with references, use decode.py.
--output also writes one JSON line {"path", "text"} per file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import load_config, parse_config
from common.config_rules import ConfigError, Count, ExistingPath, SpaceSeparated


@dataclass
class TranscribeConfig:
    """Transcribe audio files. Every field can be set as --key value; --audio takes several."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/asr"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    audio: list[Annotated[str, ExistingPath, SpaceSeparated]] = field(default_factory=list)  # audio files (any rate, any channels): --audio a.wav b.flac
    decoding: Literal["greedy", "beam"] = "greedy"  # beam: CTC prefix beam search
    beam_size: Annotated[int, Count] = 8  # prefixes kept by beam search
    lm: Annotated[str | None, ExistingPath] = None  # word n-gram LM: lm.py's folder, final/language_model/ or an .arpa; None: no LM
    beam_width: Annotated[int, Count] = 100  # hypotheses kept by the LM beam search
    lm_alpha: float | None = None  # weight of the LM's natural-log probability; None: the LM folder's attrs.json
    lm_beta: float | None = None  # score bonus per word; None: the LM folder's attrs.json
    output: str | None = None  # also write {"path", "text"} JSON lines here; None: print only


if __name__ == "__main__":  # --help and mistakes are answered before the slow imports below
    ARGS = parse_config(TranscribeConfig)

import torch  # noqa: E402

from common.data.loading import read_audio_file  # noqa: E402
from common.training.sealing import resolve_checkpoint  # noqa: E402
from common.training.faults import UsageError, run_main  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from ctc_decode import LmError, ctc_decode, lm_decode, load_lm_decoder  # noqa: E402
from data import PaddingCollator, SpecAugmentCollator, SpeechDataset  # noqa: E402
from model import checkpoint_frontend, ctc_model, recipe_weights  # noqa: E402
from text import checkpoint_tokenizer  # noqa: E402
from train import Config  # noqa: E402


def load_transcriber(args: TranscribeConfig):
    """(the run's Config, wav → text): the verified checkpoint's model and decoding (greedy, beam or
    the LM's) for waveforms (samples,) at cfg.sample_rate; tools/demo.py serves the same function."""
    if not args.lm and (args.lm_alpha is not None or args.lm_beta is not None):
        raise UsageError("--lm_alpha and --lm_beta set the LM decoding; give the LM with --lm DIR")
    if args.lm and args.decoding != "greedy":
        raise UsageError("--lm decodes with the LM beam search (--beam_width); drop --decoding beam")
    folder = resolve_checkpoint(args.checkpoint)  # verified (COMPLETE digests) before any of its files is read
    try:
        cfg = load_config(folder, Config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    tokenizer = checkpoint_tokenizer(folder)
    try:
        decoder = load_lm_decoder(args.lm, tokenizer, args.lm_alpha, args.lm_beta) if args.lm else None
    except LmError as e:
        raise UsageError(f"--lm {e}") from None
    frontend = checkpoint_frontend(folder, cfg)  # a transformers encoder's feature extractor, or None: log-mel
    model = ctc_model(cfg, tokenizer.vocab_size, frontend)
    try:
        model.load_state_dict(recipe_weights(folder, cfg))  # weights and feature statistics
    except Exception as e:  # noqa: BLE001 — sealed, yet not this config's model (SafetensorError, a shape, a key)
        raise UsageError(f"--checkpoint {folder}: its weights do not load into the model its config.yaml describes "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:300]}): re-run the training command "
                         f"that made it") from None
    model.eval()
    # the model's items and batches as decode.py makes them: log-mel or its own feature extractor's
    features = SpeechDataset(None, cfg, tokenizer, frontend=frontend).logmel
    collate = PaddingCollator() if frontend else SpecAugmentCollator(cfg, augment=False)

    @torch.no_grad()
    def transcribe(wav: torch.Tensor) -> str:
        batch = collate([("", features(wav), [], "")])  # one utterance
        log_probs, out_lens = model(batch["feats"], batch["feat_lens"])  # (1, frames, classes)
        if decoder is None:
            return tokenizer.decode(ctc_decode(log_probs, out_lens, args.decoding, args.beam_size)[0])
        return lm_decode(decoder, log_probs[0, : int(out_lens[0])].numpy(), args.beam_width)

    return cfg, transcribe


def main(args: TranscribeConfig) -> None:
    cfg, transcribe = load_transcriber(args)
    waves = [read_audio_file(path, cfg.sample_rate) for path in args.audio]  # every file checked before decoding
    rows = []
    for path, wav in zip(args.audio, waves):
        rows.append({"path": path, "text": transcribe(wav)})
        print(f"{path}\t{rows[-1]['text']}", flush=True)
    if args.output:
        Path(args.output).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


if __name__ == "__main__":
    run_main(lambda: main(ARGS))  # a refusal (UsageError): one line, exit code 2
