"""Export any ASR checkpoint as a transformers model (what training writes into final/ at the end).

    python recipes/asr/export.py --checkpoint outputs/asr/checkpoints/step_00000500 --output_dir asr_step500

--checkpoint is a training output_dir (its final/), a final/ folder, or a checkpoints/step_XXXXXXXX/
folder. Then, from anywhere:

    from transformers import pipeline
    asr = pipeline("automatic-speech-recognition", model="asr_step500", trust_remote_code=True)
    asr("speech.wav")  # or asr({"raw": samples_16khz, "sampling_rate": 16000})
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from types import SimpleNamespace

import yaml

from common.checkpoint import resolve_checkpoint
from common.config import ExistingPath, parse_config
from common.hf_export import load_recipe_ctc_weights

# recipe-local modules (this folder is on sys.path)
from model import export_hf
from text import load_tokenizer


@dataclass
class ExportConfig:
    """Export a checkpoint as a transformers model. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/asr"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    output_dir: str = "asr_export"  # the folder to write (must not exist yet)


def main():
    args = parse_config(ExportConfig)
    folder, out = resolve_checkpoint(args.checkpoint), Path(args.output_dir)
    if out.exists():
        raise SystemExit(f"error: --output_dir {out} exists; choose a new folder")
    cfg = SimpleNamespace(**yaml.safe_load((folder / "config.yaml").read_text()))
    # final/ holds its tokenizer; a checkpoints/step_X/ folder uses its run's <output_dir>/tokenizer.
    tok_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder.parent.parent / "tokenizer"
    weights = load_recipe_ctc_weights(folder)
    out.mkdir(parents=True)
    shutil.copyfile(folder / "config.yaml", out / "config.yaml")
    shutil.copytree(tok_dir, out / "tokenizer", ignore=shutil.ignore_patterns(".complete"))
    export_hf(out, weights, cfg, load_tokenizer(tok_dir))
    print(f"{out}: transformers Wav2Vec2BertForCTC + feature extractor (trust_remote_code=True)")


if __name__ == "__main__":
    main()
