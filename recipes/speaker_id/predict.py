"""Say who speaks in audio files, with a trained speaker classifier: one `path<TAB>speaker<TAB>probability`
line per file (the most probable of the training speakers, and its softmax probability).

    python recipes/speaker_id/predict.py --checkpoint outputs/speaker_id --audio a.wav b.flac
    python recipes/speaker_id/predict.py --checkpoint outputs/speaker_id/final --audio clips/*.wav --top_k 3
    python recipes/speaker_id/predict.py --checkpoint outputs/speaker_id --audio *.flac --output speakers.jsonl

--checkpoint is a training output_dir (its final/) or a final/ folder, verified against its COMPLETE
digests before it is read: the whole classifier (encoder, head, feature statistics in
model.safetensors) and the names of its outputs (speakers.json), which a checkpoints/step_*/ folder
lacks. --audio takes the files as separate arguments up to the next --flag (a shell glob works);
each is read with soundfile, mixed down to mono and resampled to the model's sample_rate as the
training data were (common.data.loading.load_audio); a file that cannot be read is refused in one
line before any is classified. --top_k N prints the N most probable speakers per file
(`speaker:probability`, tab-separated); --output also writes one JSON line {"path", "speakers":
[[speaker, probability], ...]} per file. A voice that is none of the training speakers still gets
the closest of them: the probability says how sure the model is, not whether the voice is known.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import load_config, parse_config
from common.config_rules import ConfigError, Count, ExistingPath, SpaceSeparated


@dataclass
class PredictConfig:
    """Classify audio files by speaker. Every field can be set as --key value; --audio takes several."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/speaker_id"  # training output_dir or its final/
    audio: list[Annotated[str, ExistingPath, SpaceSeparated]] = field(default_factory=list)  # audio files (any rate, any channels): --audio a.wav b.flac
    top_k: Annotated[int, Count] = 1  # speakers printed per file, most probable first
    output: str | None = None  # also write {"path", "speakers"} JSON lines here; None: print only


if __name__ == "__main__":  # --help and mistakes are answered before the slow imports below
    ARGS = parse_config(PredictConfig)

import torch  # noqa: E402

from common.data.loading import read_audio_file  # noqa: E402
from common.model.encoder import encoder_config_from  # noqa: E402
from common.model.features import LogMel  # noqa: E402
from common.training.averaging import checkpoint_weights  # noqa: E402
from common.training.sealing import resolve_checkpoint  # noqa: E402
from common.training.faults import UsageError, run_main  # noqa: E402

# recipe-local modules (this folder is on sys.path)
from model import SpeakerClassifier  # noqa: E402
from train import Config  # noqa: E402


def load_classifier(folder: Path) -> tuple[SpeakerClassifier, Config, list[str]]:
    """(the classifier in eval mode, its run's config, the speakers its outputs name) of a verified
    final/; a folder without speakers.json or whose weights do not fit its config is refused."""
    if not (folder / "speakers.json").is_file():
        raise UsageError(f"--checkpoint {folder}: no speakers.json (the names of the classifier's outputs, written "
                         f"into final/ at the end of training): give the run's output_dir or its final/")
    try:
        cfg = load_config(folder, Config)
        speakers = [str(s) for s in json.loads((folder / "speakers.json").read_text())]
    except (ConfigError, ValueError) as e:
        raise UsageError(f"--checkpoint {folder}: {e}") from None
    model = SpeakerClassifier(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                              num_speakers=len(speakers))
    try:
        model.load_state_dict(checkpoint_weights(folder))  # encoder, head and feature statistics
    except Exception as e:  # noqa: BLE001 — sealed, yet not this config's model (SafetensorError, a shape, a key)
        raise UsageError(f"--checkpoint {folder}: its weights do not load into the classifier its config.yaml and "
                         f"speakers.json describe ({type(e).__name__}: {str(e).splitlines()[0][:300]}): re-run "
                         f"the training command that made it") from None
    return model.eval(), cfg, speakers


def main(args: PredictConfig) -> None:
    folder = resolve_checkpoint(args.checkpoint)  # verified (COMPLETE digests) before any of its files is read
    model, cfg, speakers = load_classifier(folder)
    waves = [read_audio_file(path, cfg.sample_rate) for path in args.audio]  # every file checked first
    logmel, s = LogMel(cfg.sample_rate, cfg.n_mels), cfg.stack_frames
    rows = []
    with torch.no_grad():
        for path, wav in zip(args.audio, waves):
            feats = logmel(wav)  # (frames, n_mels), 10 ms hop
            n = max(s, feats.shape[0] // s * s)  # whole 40 ms encoder frames, at least one (the training collator's)
            padded = torch.zeros(1, n, cfg.n_mels)
            padded[0, : min(n, feats.shape[0])] = feats[:n]
            probs = model.logits(padded, torch.tensor([n])).float().softmax(-1)[0]  # (num_speakers,)
            top = probs.topk(min(args.top_k, len(speakers)))
            ranked = [(speakers[i], round(p, 4)) for p, i in zip(top.values.tolist(), top.indices.tolist())]
            rows.append({"path": path, "speakers": ranked})
            print("\t".join([path, *(f"{spk}:{p:.4f}" if args.top_k > 1 else f"{spk}\t{p:.4f}" for spk, p in ranked)]),
                  flush=True)
    if args.output:
        Path(args.output).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


if __name__ == "__main__":
    run_main(lambda: main(ARGS))  # a refusal (UsageError): one line, exit code 2
