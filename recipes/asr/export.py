"""Export any ASR checkpoint as a transformers model (what training writes into final/ at the end).

    python recipes/asr/export.py --checkpoint outputs/asr/checkpoints/step_00000500 --output_dir asr_step500

--checkpoint is a training output_dir (its final/), a final/ folder, or a checkpoints/step_XXXXXXXX/
folder (verified against its COMPLETE marker first). The export is written aside and sealed with its
own COMPLETE marker, like a training final/, so decode.py and the other tools accept it. Then, from anywhere:

    from transformers import pipeline
    asr = pipeline("automatic-speech-recognition", model="asr_step500", trust_remote_code=True)
    asr("speech.wav")  # or asr({"raw": samples_16khz, "sampling_rate": 16000})

--lm DIR (a folder from lm.py, checked against its COMPLETE marker first) ships a word n-gram LM in the
export (language_model/, alphabet.json, processor class Wav2Vec2ProcessorWithLM): the pipeline then
decodes with pyctcdecode's beam search and the LM (with `pyctcdecode` and `kenlm` installed; without
them transformers warns and decodes greedily).
--lm_alpha/--lm_beta (e.g. what decode.py --tune_lm chose) replace the LM folder's attrs.json.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated


sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.training.sealing import resolve_checkpoint, seal_export
from common.config import load_config, parse_config
from common.config_rules import ExistingPath
from common.training.faults import run_main

# recipe-local modules (this folder is on sys.path)
from ctc_decode import LmError, export_lm, load_lm_decoder
from model import checkpoint_frontend, export_hf, frontend_dir, recipe_weights
from common.model.hf_encoder import FAMILIES
from text import checkpoint_tokenizer, tokenizer_dir
from train import Config


@dataclass
class ExportConfig:
    """Export a checkpoint as a transformers model. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/asr"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    output_dir: str = "asr_export"  # the folder to write (must not exist yet)
    lm: Annotated[str | None, ExistingPath] = None  # a word n-gram LM folder from lm.py to ship with the model; None: none
    lm_alpha: float | None = None  # weight of the LM's natural-log probability; None: the LM folder's attrs.json
    lm_beta: float | None = None  # score bonus per word; None: the LM folder's attrs.json


def main():
    args = parse_config(ExportConfig)
    folder, out = resolve_checkpoint(args.checkpoint), Path(args.output_dir)
    if out.exists():
        raise SystemExit(f"error: --output_dir {out} exists; choose a new folder")
    cfg = load_config(folder, Config)
    tokenizer = checkpoint_tokenizer(folder)
    if not args.lm and (args.lm_alpha is not None or args.lm_beta is not None):
        raise SystemExit("error: --lm_alpha and --lm_beta are the shipped LM's weights; give the LM with --lm DIR")
    if args.lm and tokenizer.kind != "char":
        raise SystemExit("error: --lm needs a character model: a BPE export has no transformers tokenizer, so the "
                         "pipeline cannot load it; decode BPE models with the LM through decode.py --lm")
    if args.lm:
        try:
            load_lm_decoder(args.lm, tokenizer)  # before writing anything
        except LmError as e:
            raise SystemExit(f"error: --lm {e}") from None
    frontend = checkpoint_frontend(folder, cfg)  # a transformers encoder's run: its stock <Family>ForCTC
    weights = recipe_weights(folder, cfg)
    # Written aside and sealed like a training final/ (COMPLETE digests, then renamed into place):
    # decode.py and the other tools read only sealed folders, and a kill leaves no half export.
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(folder / "config.yaml", tmp / "config.yaml")
    shutil.copytree(tokenizer_dir(folder), tmp / "tokenizer", ignore=shutil.ignore_patterns(".complete"))
    if frontend is not None:
        shutil.copytree(frontend_dir(folder), tmp / "frontend", ignore=shutil.ignore_patterns(".complete"))
    export_hf(tmp, weights, cfg, tokenizer, frontend)
    if args.lm:
        export_lm(tmp, args.lm, tokenizer, args.lm_alpha, args.lm_beta)
    seal_export(tmp)
    os.rename(tmp, out)
    print(f"{out}: transformers " + (f"{FAMILIES[cfg.encoder_type].ctc} + its feature extractor (no remote code)"
                                      if frontend else "Wav2Vec2BertForCTC + feature extractor (trust_remote_code=True)")
          + (f" + the n-gram LM of {args.lm} (Wav2Vec2ProcessorWithLM)" if args.lm else ""))


if __name__ == "__main__":
    run_main(main)  # a refused --checkpoint (common.training.sealing.resolve_checkpoint): one line, exit code 2
