"""Copy-synthesis of held-out utterances: the mels of real recordings → this vocoder, and → Griffin-Lim
(the TTS recipe's, same mels); PESQ (wide-band, at 16 kHz), STOI and MCD (DTW) of each against the recording.

    python recipes/vocoder/evaluate.py --checkpoint outputs/vocoder
    python recipes/vocoder/evaluate.py --checkpoint outputs/vocoder/final --data_dir /data/LJSpeech-1.1 --num_test 100

The utterances: the last --num_test ids (sorted) of the corpus, the ones training held out (the TTS
recipe holds out the same with the same --num_test). Writes, into the run's output_dir (for a
checkpoints/step_X/ folder: <output_dir>/eval/step_X/; never into the sealed final/ or step folder),
eval_test.json (per utterance and means; `*_rtf`: seconds of synthesis per second of audio, this
process's threads), eval_test.md (the table), eval_test.html (tools/report.py: per utterance the
recording beside both copy-syntheses, to listen to, with their scores, sortable; its files in
eval_test_files/) and <id>.png for the first
--num_images utterances (log-mels top to bottom: recording, Griffin-Lim, vocoder). --per_band true adds
STOI per one-third-octave band (`stoi_per_band`: pystoi's computation, not averaged over its 15 bands,
150 Hz to 3.8 kHz), mean over the utterances, to both files: where in frequency a vocoder loses STOI;
and the same of a third signal, `vocoder_magnitude`: the magnitude the generator's head predicts, phased
by Griffin-Lim instead of by the head: where it scores above the vocoder, the head's phase costs the difference.
The vocoder synthesizes as the run says (`refine_iters` of its config.yaml: the phase refinement);
--refine_iters N overrides it (0: the network's own output, what training optimized).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config import parse_config
from common.config_rules import Count, ExistingPath, NonNegative
from common.data.loading import resample


@dataclass
class EvalConfig:
    """Score a vocoder. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/vocoder"  # training output_dir or its final/
    data_dir: Annotated[str | None, ExistingPath] = None  # LJSpeech layout; None = the corpus the vocoder trained on (built-in: regenerated if missing)
    num_test: Annotated[int | None, Count] = None  # the last num_test ids; None = the training run's --num_test
    griffin_lim_iters: Annotated[int, Count] = 60
    refine_iters: Annotated[int | None, NonNegative] = None  # the vocoder's phase refinement; None = the run's (config.yaml), 0 = the network's output
    num_images: Annotated[int, NonNegative] = 2  # mel pictures of the first utterances
    per_band: bool = False  # also STOI per one-third-octave band (mean over utterances)


def stoi_per_band(ref, out, sample_rate: int):
    """STOI (Taal et al. 2011) of `out` against `ref` (1-D float arrays, same length) kept per
    one-third-octave band: (15,), pystoi's steps (10 kHz, silent frames removed, 384 ms segments, the
    −15 dB clip) with the correlations averaged over segments only; their mean over bands is
    pystoi.stoi(ref, out, sample_rate). None where fewer than 30 frames of speech remain (pystoi then
    returns 1e-5)."""
    import importlib

    import numpy as np
    from pystoi import utils

    S = importlib.import_module("pystoi.stoi")  # the module (the package's `stoi` attribute is the function)

    if sample_rate != S.FS:
        ref, out = utils.resample_oct(ref, S.FS, sample_rate), utils.resample_oct(out, S.FS, sample_rate)
    ref, out = utils.remove_silent_frames(ref, out, S.DYN_RANGE, S.N_FRAME, S.N_FRAME // 2)
    # (bands, frames) one-third-octave magnitudes
    x, y = (np.sqrt(S.OBM @ np.abs(utils.stft(v, S.N_FRAME, S.NFFT, overlap=2).T) ** 2) for v in (ref, out))
    if x.shape[1] < S.N:
        return None
    # (segments, bands, N frames)
    xs, ys = (np.stack([v[:, m - S.N:m] for m in range(S.N, v.shape[1] + 1)]) for v in (x, y))
    ys = ys * np.linalg.norm(xs, axis=2, keepdims=True) / (np.linalg.norm(ys, axis=2, keepdims=True) + utils.EPS)
    ys = np.minimum(ys, xs * (1 + 10 ** (-S.BETA / 20)))
    xs, ys = (v - v.mean(axis=2, keepdims=True) for v in (xs, ys))
    xs, ys = (v / (np.linalg.norm(v, axis=2, keepdims=True) + utils.EPS) for v in (xs, ys))
    return (xs * ys).sum(axis=2).mean(axis=0)


def html_report(page: Path, report: dict, heard: dict[str, dict], sealed: Path) -> None:
    """eval_test.html (tools/report.py): the means, the run's training curves, and per utterance the
    recording beside its copy-synthesis by Griffin-Lim and by the vocoder, with PESQ, STOI and MCD."""
    from common.training.sealing import run_dir_of
    from tools.report import command_line, training_curves, write_report

    rows = [{**r, **heard[r["id"]]} for r in report["utterances"]]
    columns = [("id", "id", "text"), ("recording", "recording", "audio"), ("griffin_lim", "Griffin-Lim", "audio"),
               ("vocoder", "vocoder", "audio")]
    columns += [(f"{name}_{m}", f"{shown} {label}", "num") for name, shown in (("griffin_lim", "GL"), ("vocoder", "vocoder"))
                for m, label in (("pesq", "PESQ"), ("stoi", "STOI"), ("mcd", "MCD (dB)"))]
    columns.append(("image", "log-mel: recording, Griffin-Lim, vocoder", "image"))
    summary = {"checkpoint": str(sealed), "refine_iters": report["refine_iters"], "utterances": len(rows),
               **{f"mean {k}": v for k, v in report["mean"].items()}}
    curves = training_curves(run_dir_of(sealed) / "metrics.jsonl", page)
    write_report(page, "Vocoder: copy-synthesis of held-out recordings", summary, columns, rows, command_line(),
                 [("training curves", curves)] if curves else [], sort="vocoder_mcd")


def main() -> None:
    args = parse_config(EvalConfig)
    import numpy as np
    import soundfile as sf
    import torch
    import torchaudio
    from PIL import Image
    from pesq import pesq
    from pystoi import stoi

    from common.training.sealing import resolve_checkpoint
    from common.data.loading import load_audio
    from common.model.features import mel_frontend
    from common.data.manifest import read_corpus
    from common.model.vocoding import GriffinLim, mcd_dtw
    from tools.corpus import resolve_data_dir
    from tools.report import files_dir, place

    sys.path.insert(0, str(Path(__file__).parent))
    from model import load_vocoder, vocode
    from train import Config

    from common.config import load_config
    from common.config_rules import ConfigError
    from common.training.faults import UsageError

    try:
        sealed = resolve_checkpoint(args.checkpoint)  # verified (COMPLETE digests) before any file is read
        generator, cfg = load_vocoder(sealed, load_config(sealed, Config))
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # Beside the checkpoint, never inside: final/ and checkpoints/step_X/ are sealed (COMPLETE digests).
    if sealed.parent.name == "checkpoints":
        folder = sealed.parent.parent / "eval" / sealed.name
    else:
        folder = sealed.parent
    folder.mkdir(parents=True, exist_ok=True)
    if args.data_dir is None and cfg.dataset_name:  # a source's run holds out no test utterances
        print(f"error: {args.checkpoint} was trained on --dataset_name {cfg.dataset_name}, which held out no test "
              f"utterances: give --data_dir (an LJSpeech-layout folder or an audiofolder)", file=sys.stderr)
        raise SystemExit(2)
    data_dir = args.data_dir or resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "ljspeech")
    manifest = read_corpus(data_dir, text=False).sort("id")  # LJSpeech layout or an audiofolder
    num_test = args.num_test or cfg.num_test
    test = manifest.select(range(len(manifest) - num_test, len(manifest)))
    frontend = mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length)
    griffin_lim = GriffinLim(frontend, n_iter=args.griffin_lim_iters)

    def scores(ref, out, ref_mel) -> dict:
        n = min(len(ref), len(out))
        ref16, out16 = (resample(x[:n], cfg.sample_rate, 16000).numpy() for x in (ref, out))
        return {"pesq": float(pesq(16000, ref16, out16, "wb")),
                "stoi": float(stoi(ref[:n].numpy(), out[:n].numpy(), cfg.sample_rate, extended=False)),
                "mcd": mcd_dtw(frontend(out).numpy(), ref_mel.numpy())}

    rows, bands = [], {"griffin_lim": [], "vocoder": [], "vocoder_magnitude": []}
    page = folder / "eval_test.html"
    heard = {}  # id → {"recording", "griffin_lim", "vocoder", "image"}: the report's files, relative to it
    (files_dir(page) / "audio").mkdir(parents=True, exist_ok=True)
    rephase = torchaudio.transforms.GriffinLim(n_fft=generator.n_fft, n_iter=args.griffin_lim_iters,
                                               hop_length=generator.hop, power=1.0)  # Hann of n_fft, as the head's
    for i, row in enumerate(test):
        wav = load_audio(row["path"], cfg.sample_rate)
        mel = frontend(wav)
        outs, seconds = {}, {}
        for name, synthesize in (("griffin_lim", griffin_lim), ("vocoder", lambda m: vocode(generator, m, args.refine_iters))):
            start = time.perf_counter()
            outs[name] = synthesize(mel)
            seconds[f"{name}_rtf"] = (time.perf_counter() - start) / (len(wav) / cfg.sample_rate)  # s per audio s
        rows.append({"id": row["id"], **{f"{k}_{m}": v for k, out in outs.items() for m, v in scores(wav, out, mel).items()},
                     **seconds})
        print(json.dumps(rows[-1]), flush=True)
        heard[row["id"]] = {"recording": place(row["path"], page, f"audio/{row['id']}{Path(row['path']).suffix}")}
        for name, out in outs.items():
            sf.write(files_dir(page) / "audio" / f"{row['id']}_{name}.wav", out.numpy(), cfg.sample_rate, subtype="PCM_16")
            heard[row["id"]][name] = f"{files_dir(page).name}/audio/{row['id']}_{name}.wav"
        if args.per_band:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # Griffin-Lim's random initial phase: the same every run
                magnitude = rephase(generator.spectrum(mel.float()[None])[0].abs())
            for name, out in {**outs, "vocoder_magnitude": magnitude}.items():
                n = min(len(wav), len(out))
                per_band = stoi_per_band(wav[:n].double().numpy(), out[:n].double().numpy(), cfg.sample_rate)
                if per_band is not None:
                    bands[name].append(per_band)
        if i < args.num_images:
            mels = [mel, frontend(outs["griffin_lim"]), frontend(outs["vocoder"])]
            lo, hi = float(mel.min()), float(mel.max())
            image = np.concatenate([(255 * ((m.T.flip(0) - lo) / (hi - lo)).clamp(0, 1)).to(torch.uint8).numpy()
                                    for m in mels])
            Image.fromarray(image).save(folder / f"{row['id']}.png")
            heard[row["id"]]["image"] = place(folder / f"{row['id']}.png", page, f"images/{row['id']}.png")
    means = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k != "id"}
    iters = generator.refine_iters if args.refine_iters is None else args.refine_iters
    report = {"refine_iters": iters, "utterances": rows, "mean": means}
    table = ["| | PESQ (wb) ↑ | STOI ↑ | MCD (dB) ↓ | s per audio s |", "|---|---|---|---|---|"]
    for name in ("griffin_lim", "vocoder"):
        name_shown = f"vocoder, refine_iters {iters}" if name == "vocoder" else name
        table.append(f"| {name_shown} | {means[f'{name}_pesq']:.3f} | {means[f'{name}_stoi']:.3f} | {means[f'{name}_mcd']:.2f} | {means[f'{name}_rtf']:.3f} |")
    if args.per_band:
        from pystoi.stoi import CF

        report["stoi_bands"] = {"centre_hz": [float(c) for c in CF], "utterances": len(bands["vocoder"]),
                                **{k: np.mean(v, axis=0).tolist() for k, v in bands.items()}}
        table += ["", f"STOI per one-third-octave band ({len(bands['vocoder'])} utterances)", "",
                  "| band centre (Hz) | " + " | ".join(f"{c:.0f}" for c in CF) + " |", "|---" * (len(CF) + 1) + "|"]
        table += [f"| {k} | " + " | ".join(f"{v:.3f}" for v in report["stoi_bands"][k]) + " |" for k in bands]
    (folder / "eval_test.json").write_text(json.dumps(report, indent=1) + "\n")
    (folder / "eval_test.md").write_text(f"{len(rows)} held-out utterances of {data_dir}\n\n" + "\n".join(table) + "\n")
    html_report(page, report, heard, sealed)
    print("\n".join(table))


if __name__ == "__main__":
    main()
