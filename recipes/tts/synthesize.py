"""Text → speech with a trained TTS checkpoint and the voice's own neural vocoder (recipes/vocoder), or
Griffin-Lim.

    python recipes/tts/synthesize.py --checkpoint outputs/tts --text "a radio wrote this clever pencil" --output out.wav
    python recipes/tts/synthesize.py --checkpoint outputs/tts/final --text_file lines.txt --output_dir wavs/
    python recipes/tts/synthesize.py --checkpoint outputs/tts --vocoder outputs/vocoder --text "..." --output out.wav

--checkpoint is a training output_dir (its final/ is used), a final/ folder, or a
checkpoints/step_XXXXXXXX/ folder (audio comes out of any checkpoint). With --text_file, one wav
per non-empty line: <output_dir>/0001.wav, 0002.wav, ... 22.05 kHz 16-bit PCM (the model's rate).
--vocoder auto (the default) takes the TTS run's own vocoder, <its output_dir>/vocoder (what
`accelerate launch recipes/vocoder/train.py --tts_run <its output_dir>` trains), when that folder
exists: one line names it, and one that is unfinished, damaged, or trained on other data or another
mel is refused (never replaced by Griffin-Lim unasked); without it, Griffin-Lim, and one line says so
and gives the command that trains the voice's vocoder. --vocoder griffin_lim: Griffin-Lim.
--vocoder PATH: a vocoder training output_dir or its final/. A vocoder's weights and config.yaml are
read once its COMPLETE marker's digests match, its code is this repository's recipes/vocoder/model.py
(the folder's vocoder_model.py, for use outside the repository, is never imported here), and a vocoder
trained on another mel (sample rate, n_mels, window, hop) is refused. A sentence with symbols the
model does not know, or an output that cannot be written, is refused before anything is synthesized.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import soundfile as sf

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.training.averaging import checkpoint_weights
from common.training.sealing import resolve_checkpoint, run_dir_of
from common.config import load_config, parse_config
from common.config_rules import ConfigError, Count, ExistingPath, ExistingPathOr, NonNegative, Positive
from common.training.faults import UsageError, run_main
from tools.recipe_import import recipe_modules

# recipe-local modules (this folder is on sys.path)
from audio import make_vocoder
from model import load_tts, synthesize
from train import Config

AUTO, GRIFFIN_LIM = "auto", "griffin_lim"  # --vocoder's words: the TTS run's own vocoder if it has one; Griffin-Lim
RUN_VOCODER = "vocoder"  # <TTS output_dir>/vocoder: where `recipes/vocoder/train.py --tts_run` trains the voice's vocoder


@dataclass
class SynthConfig:
    """Synthesize speech. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/tts"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    text: str | None = None  # one sentence
    output: str = "out.wav"  # wav file for --text
    text_file: Annotated[str | None, ExistingPath] = None  # one sentence per line
    output_dir: str = "synthesized"  # folder for --text_file
    pace: Annotated[float, Positive] = 1.0  # > 1 speaks faster (durations divided by pace)
    griffin_lim_iters: Annotated[int, Count] = 60
    griffin_lim_power: Annotated[float, Positive] = 1.0  # > 1 sharpens magnitudes before phase recovery
    vocoder: Annotated[str, ExistingPathOr(AUTO, GRIFFIN_LIM)] = AUTO  # auto: the TTS run's own (<its output_dir>/vocoder) if there, else Griffin-Lim (said in one line); griffin_lim; or a recipes/vocoder output_dir or its final/
    vocoder_refine_iters: Annotated[int | None, NonNegative] = None  # its phase refinement (recipes/vocoder README); None = the vocoder run's


def refuse(message: str) -> typing.NoReturn:
    """A mistake in the command: one line on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class PickedVocoder(typing.NamedTuple):
    named: str  # as --vocoder named it (auto: <the TTS run>/vocoder)
    folder: Path  # its final/, verified


def pick_vocoder(choice: str, folder: Path, tts_cfg, refine_iters: int | None = None) -> PickedVocoder | None:
    """The neural vocoder `--vocoder choice` names for the TTS model in `folder` (a resolved checkpoint): as
    named, and its final/, verified (COMPLETE digests: refused unfinished or damaged); None for Griffin-Lim. `auto`:
    its run's own, <run>/vocoder, when that folder exists (a line names it; refused when trained on other
    data; `neural_vocoder` refuses another mel), else Griffin-Lim (a line says so and gives the command
    that trains the voice's vocoder). `refine_iters` (--vocoder_refine_iters) without a neural vocoder is
    refused."""
    path = None if choice in (AUTO, GRIFFIN_LIM) else choice
    if choice == AUTO:
        run = run_dir_of(folder)
        own = run / RUN_VOCODER
        train = f"accelerate launch recipes/vocoder/train.py --tts_run {run}"
        if own.exists():
            path = str(own)
            print(f"--vocoder auto: the voice's own vocoder, {own} (--vocoder griffin_lim: Griffin-Lim instead)", flush=True)
        else:
            print(f"--vocoder auto: Griffin-Lim ({run} has no {RUN_VOCODER}/); the voice's own neural vocoder sounds "
                  f"better (PESQ, MCD): train it with `{train}`, then run this again", flush=True)
    if refine_iters is not None and path is None:
        refuse("--vocoder_refine_iters refines a neural vocoder's output: give --vocoder PATH, or train the TTS run's own "
               "(recipes/vocoder/train.py --tts_run); Griffin-Lim's own setting is --griffin_lim_iters")
    if path is None:
        return None
    try:  # hashed once here; neural_vocoder reads this folder
        resolved = resolve_checkpoint(path, "--vocoder auto: the TTS run's vocoder" if choice == AUTO else "--vocoder")
    except UsageError as e:
        refuse(f"{e} (--vocoder griffin_lim: Griffin-Lim meanwhile)" if choice == AUTO else str(e))
    if choice == AUTO:  # trained for this run's data: its held-out sentences unheard
        _, train_module = vocoder_recipe()
        try:
            theirs = load_config(resolved, train_module.Config)
        except ConfigError as e:
            refuse(f"{e} (--vocoder griffin_lim: Griffin-Lim meanwhile)")
        keys = [k for k in train_module.tts_run_keys(tts_cfg.data_dir, tts_cfg.dataset_name) if k != "data_cache_dir"]
        differ = [f"{k} {getattr(theirs, k)} vs {getattr(tts_cfg, k)}" for k in keys if getattr(theirs, k) != getattr(tts_cfg, k)]
        if differ:
            refuse(f"--vocoder auto: {path} was trained on other data than this TTS model ({', '.join(differ)}): "
                   f"train it again for this run (`{train} --resume false`), or give --vocoder griffin_lim")
    return PickedVocoder(path, resolved)


def vocoder_recipe():
    """recipes/vocoder's model.py and train.py (its Config), imported as that recipe's scripts import them
    (tools/recipe_import.py: its plain names kept apart from this recipe's `model`, `train`)."""
    modules = recipe_modules("vocoder", "model", "train")
    return modules.model, modules.train


def neural_vocoder(picked: PickedVocoder, tts_cfg, refine_iters: int | None = None):
    """mel → waveform with the generator `pick_vocoder` found (and verified).
    Only its weights and config.yaml are read: the code is this repository's recipes/vocoder/model.py,
    never the copy the export carries for use elsewhere. Refuses, with one line, a vocoder whose mel is
    not the TTS model's."""
    path, folder = picked
    if not (folder / "vocoder_model.py").is_file():  # (only a sign of what made the folder: never imported)
        refuse(f"--vocoder {path}: {folder} is not a recipes/vocoder final/ (no vocoder_model.py in it)")
    code, train = vocoder_recipe()
    try:
        vocoder_cfg = load_config(folder, train.Config)
    except ConfigError as e:
        refuse(f"--vocoder {e}")
    mismatch = code.mel_mismatch(vocoder_cfg, tts_cfg)
    if mismatch:  # before the weights: another n_mels would not even load
        refuse(f"--vocoder {path} was trained on another mel than this TTS model ({mismatch}): "
               f"train the vocoder with the TTS model's --sample_rate/--n_mels/--win_length/--hop_length")
    try:
        generator, _ = code.load_vocoder(folder, vocoder_cfg)
    except Exception as e:  # noqa: BLE001 — sealed, yet not the generator its config.yaml describes
        refuse(f"--vocoder {folder}: its weights do not load into the generator its config.yaml describes "
               f"({type(e).__name__}: {str(e).splitlines()[0][:300]}): re-run the training command that made it")
    return lambda mel: code.vocode(generator, mel, refine_iters)


def writable(path: Path, flag: str) -> None:
    """Refuse, before any synthesis, an output that cannot be written: one line naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            refuse(f"{flag} {path} is a folder: give a .wav file name")
        existed = path.exists()
        with open(path, "ab"):  # opened, not truncated: an existing file keeps its content until written
            pass
        if not existed:
            path.unlink()  # no empty file left behind if a later sentence is refused
    except OSError as e:
        refuse(f"{flag} {path}: cannot write there ({e.strerror or e}): choose another path")


def main():
    args = parse_config(SynthConfig)
    if (args.text is None) == (args.text_file is None):
        refuse("give exactly one of --text or --text_file")
    try:
        folder = resolve_checkpoint(args.checkpoint)  # verified (COMPLETE digests) before any file is read
        model, cfg, symbols, _ = load_tts(folder, load_config(folder, Config), checkpoint_weights(folder))
    except (UsageError, ConfigError) as e:
        refuse(str(e))
    vocoder_path = pick_vocoder(args.vocoder, folder, cfg, args.vocoder_refine_iters)
    if args.text is not None:
        jobs = [("--text", args.text, Path(args.output))]
    else:
        lines = [(n, line) for n, line in enumerate(Path(args.text_file).read_text().splitlines(), 1) if line.strip()]
        jobs = [(f"--text_file {args.text_file} line {n}", line, Path(args.output_dir) / f"{i:04d}.wav")
                for i, (n, line) in enumerate(lines, 1)]
    for where, text, _ in jobs:  # every sentence and output checked before the first is synthesized
        try:
            symbols.encode(text)
        except ValueError as e:
            refuse(f"{where}: {e}; this model's symbols: {''.join(symbols.chars)!r}")
    for _, _, path in jobs:
        writable(path, "--output" if args.text is not None else "--output_dir")
    if vocoder_path is not None:
        vocoder = neural_vocoder(vocoder_path, cfg, args.vocoder_refine_iters)
    else:
        vocoder = make_vocoder(cfg, args.griffin_lim_iters, args.griffin_lim_power)
    for _, text, path in jobs:
        wav, mel, _ = synthesize(model, symbols, text, vocoder, args.pace)
        sf.write(path, wav.numpy(), cfg.sample_rate, subtype="PCM_16")
        print(f"{path}: {len(wav) / cfg.sample_rate:.2f} s  ← {symbols.normalize(text)!r}", flush=True)


if __name__ == "__main__":
    run_main(main)  # its exit skips the last garbage collection (seconds): common.training.faults
