"""Score a TTS checkpoint on held-out sentences: mel-cepstral distortion, alignment checks, and
(optionally) intelligibility with the ASR recipe.

    python recipes/tts/score.py --checkpoint outputs/tts --split test
    python recipes/tts/score.py --checkpoint outputs/tts --split test --asr_checkpoint outputs/asr
    python recipes/tts/score.py --checkpoint outputs/tts --split test --vocoder griffin_lim --asr_checkpoint outputs/asr

Data settings (data_dir, built-in corpus, split sizes) come from the checkpoint's config.yaml, so the
held-out ids are exactly the ones training never saw (`--split validation` scores those instead).
`--split all --data_dir DIR` scores every sentence of another folder of the voice instead, those the TTS
trained on left out and named (its run's data checks say which): a test set as large as a comparison
needs, e.g. the built-in voice's `python -m tools.corpus --heldout 300 --out DIR` (its own holds 20).

Per utterance: the model synthesizes the sentence from text alone (predicted durations) and
- MCD (dB) against the recording: mel-cepstra c1..c13 = (1/M) · DCT-II of the natural-log mel
  amplitude (½ log power mel, M = 80 bins), c0 excluded; MCD = (10 / ln 10) · sqrt(2 · Σ_d (Δc_d)²),
  averaged over the frame pairs of a Euclidean DTW path. Reported for the model's log-mel
  (`mcd`, vocoder-independent), for the log-mel re-analysed from the vocoded audio (`mcd_vocoded`),
  and for the vocoder applied to the *recording's* mel (`mcd_vocoder_floor`: what the vocoder alone
  costs). The vocoder is synthesize.py's --vocoder choice: by default (auto) the TTS run's own
  recipes/vocoder model, <its output_dir>/vocoder, else Griffin-Lim (one line says which; one trained
  on another mel or other data is refused); and PESQ (wide-band, at 16 kHz, as recipes/vocoder/evaluate.py)
  of that vocoder applied to the recording's mel against the recording (`pesq_vocoder_floor`: time-aligned,
  unlike the synthesized sentence);
- length ratio (synthesized / recorded frames) and the log-energy envelope correlation after DTW;
- alignment (teacher-forced on the recording): the hard durations sum to the mel length, the path
  is monotonic (each frame's symbol index is the previous one or the next), and how peaked the soft
  alignment is (mean max probability per frame; agreement of its argmax with the hard path).
With --asr_checkpoint, the synthesized sentences are resampled to 16 kHz and written as FLAC in a
LibriSpeech layout `<output>/librispeech/<split>/1/1/1-1-NNNN.flac` + `1-1.trans.txt` (uppercase),
and the ASR recipe's evaluator is run on them as a subprocess; its WER/CER are reported (and, with
--asr_recordings true (default), the same for the recordings in <output>/recordings/librispeech/;
with --asr_vocoder_floor true, for the vocoder applied to the recordings' own mel, in
<output>/vocoder_floor/: what the vocoder alone costs the judge, `asr_vocoder_floor`).
The judge must not have trained on the sentences it reads: those it did (its run's training
manifests, words compared without case and punctuation) are named and left out of both ASR scores
(`asr_judge` in the summary says which and how many were scored); a judge whose training sentences
cannot be read, or whose manifests changed since its data check sealed them, is refused
(`--asr_judge_check false` scores every sentence, unchecked).
Writes <output>/<split>.json (summary), <output>/<split>.jsonl (per utterance), wavs/,
<output>/<split>.html (tools/report.py: per utterance the synthesized audio beside the recording, mel
and alignment pictures, the judge's transcript with its errors marked, length ratio and MCD, sortable;
its files in <split>_files/), and a spectrogram picture <output>/<first id>.png (synthesized above, recording below) and its
alignment <output>/<first id>_alignment.png (soft above, hard below; symbols up, frames right).
<output> defaults to <output_dir>/eval/<checkpoint name>/ (e.g. outputs/tts/eval/final/) with Griffin-Lim, and to
<output_dir>/eval/<checkpoint name>+vocoder/ with a neural vocoder: beside the checkpoint, never inside it (final/ and step folders are sealed by their digests).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import soundfile as sf
import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.training.averaging import checkpoint_weights
from common.training.sealing import resolve_checkpoint, run_dir_of
from common.config import load_config, parse_config
from common.config_rules import ConfigError, Count, ExistingPath, ExistingPathOr, NonNegative
from common.data.loading import load_audio, resample
from common.training.faults import UsageError, run_main
from common.data.manifest import DataError, DataPolicy, prepare_manifest, split_manifest
from common.data.source import run_manifests
from tools.corpus import resolve_data_dir
from tools.report import files_dir

# recipe-local modules (this folder is on sys.path)
from audio import dtw_path, make_vocoder, mcd_dtw, mel_cepstra, mel_frontend, stack_images, to_image, write_png
from data import Collator, TTSDataset
from model import load_tts, synthesize
from synthesize import AUTO, GRIFFIN_LIM, neural_vocoder, pick_vocoder, refuse
from train import Config

RECIPES = Path(__file__).resolve().parents[1]


@dataclass
class EvalConfig:
    """Evaluate synthesis on held-out sentences. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/tts"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    split: Literal["test", "validation", "all"] = "test"  # the checkpoint's deterministic split; all: every sentence of --data_dir the TTS did not train on
    data_dir: Annotated[str | None, ExistingPath] = None  # None: the checkpoint's data_dir (or its built-in corpus)
    data_cache_dir: str | None = None  # None: the checkpoint's
    output: str | None = None  # None = <output_dir>/eval/<checkpoint name> (beside it, never inside)
    griffin_lim_iters: Annotated[int, Count] = 60
    vocoder: Annotated[str, ExistingPathOr(AUTO, GRIFFIN_LIM)] = AUTO  # auto: the TTS run's own (<its output_dir>/vocoder) if there, else Griffin-Lim (said in one line); griffin_lim; or a recipes/vocoder output_dir or final/
    vocoder_refine_iters: Annotated[int | None, NonNegative] = None  # its phase refinement (recipes/vocoder README); None = the vocoder run's
    asr_checkpoint: Annotated[str | None, ExistingPath] = None  # ASR recipe output_dir: also measure intelligibility (WER/CER)
    asr_sample_rate: Annotated[int, Count] = 16000  # Hz of the audio handed to the ASR evaluator
    asr_recordings: bool = True  # also score the held-out *recordings* (the ASR's ceiling on this voice)
    asr_judge_check: bool = True  # leave out of the ASR scores the sentences the judge trained on (false: score all, unchecked)
    asr_vocoder_floor: bool = False  # also score the vocoder applied to the *recordings'* mel: what the vocoder alone costs the judge


def wideband_pesq(ref: torch.Tensor, out: torch.Tensor, sample_rate: int) -> float:
    """Wide-band PESQ (ITU-T P.862.2) of `out` against `ref` (time-aligned samples at `sample_rate`), both
    cut to the shorter and resampled to 16 kHz: recipes/vocoder/evaluate.py's."""
    from pesq import pesq

    n = min(len(ref), len(out))
    ref16, out16 = (resample(x[:n], sample_rate, 16000).numpy() for x in (ref, out))
    return float(pesq(16000, ref16, out16, "wb"))


def envelope_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Correlation of the frame log-energies (log Σ mel power) along the DTW path of the cepstra."""
    ia, ib = np.array(dtw_path(mel_cepstra(a), mel_cepstra(b))).T
    ea, eb = np.log(np.exp(a).sum(1))[ia], np.log(np.exp(b).sum(1))[ib]
    return float(np.corrcoef(ea, eb)[0, 1])


def words(text: str) -> str:
    """A sentence's words, case and punctuation aside: what "the same sentence" means here."""
    return " ".join(re.findall(r"\w+", text.casefold()))


def tts_heard(folder: Path, cfg: Config, texts: dict[str, str]) -> list[str]:
    """The ids whose sentence the TTS checkpoint trained on (`words`): for `--split all`, whose folder may hold
    them (a new recording of a training prompt). Read from its run: every data check it wrote,
    `<run>/data/all-*/manifest.jsonl`, less each one's held-out split (`split_manifest`, as training splits it)."""
    fix = "score its held-out split instead (--split test or validation)"
    try:
        checked = run_manifests(run_dir_of(folder), "all", by_folder=True)
    except DataError as e:
        refuse(f"--split all: which sentences {folder} trained on cannot be read: {e}; or {fix}")
    if checked is None:
        refuse(f"--split all: which sentences {folder} trained on cannot be checked (no {run_dir_of(folder)}/data/"
               f"all-*/manifest.jsonl: a run trained from a data folder keeps them, a `datasets` source or a copied "
               f"final/ does not): {fix}")
    trained = {words(row["text"]) for rows in checked for row in rows[:len(rows) - cfg.num_valid - cfg.num_test]}
    return sorted(i for i, text in texts.items() if words(text) in trained)


def judge_heard(asr_checkpoint: str, texts: dict[str, str]) -> list[str]:
    """The ids whose sentence the ASR judge trained on (the same words, case and punctuation aside):
    an intelligibility figure must come from sentences the judge never heard, or it flatters the
    synthesis (real prompt sets repeat sentences: 1-3 of each language's test prompts are also
    training prompts). Read from the judge's run: the training manifests its data preparation wrote,
    `<run>/data/train-*/manifest.jsonl` (all of them: a run resumed on changed data has several), each
    checked against its marker and line by line (`common.data.source.run_manifests`)."""
    try:
        folder = resolve_checkpoint(asr_checkpoint, "--asr_checkpoint")
    except UsageError as e:
        refuse(str(e))
    run_dir = run_dir_of(folder)
    try:
        rows = run_manifests(run_dir, "train")  # checked against their markers, line by line
    except DataError as e:
        refuse(f"--asr_checkpoint {asr_checkpoint}: which sentences this judge trained on cannot be read: {e}; "
               f"or pass --asr_judge_check false")
    if rows is None:
        refuse(f"--asr_checkpoint {asr_checkpoint}: which sentences this judge trained on cannot be checked (no "
               f"{run_dir}/data/train-*/manifest.jsonl: a run trained from a data folder keeps them, a `datasets` "
               f"source or a copied final/ does not): judge with such a run, or pass --asr_judge_check false")
    heard = {words(row["text"]) for row in rows}
    return sorted(i for i, text in texts.items() if words(text) in heard)


def run_asr(args: EvalConfig, wavs: dict[str, torch.Tensor], texts: dict[str, str], sample_rate: int,
            out: Path) -> dict:
    """Write `wavs` as a one-speaker LibriSpeech split under `out` and run the ASR evaluator on it."""
    shutil.rmtree(out / "librispeech" / args.split, ignore_errors=True)  # a previous score's files are not this one's
    chapter = out / "librispeech" / args.split / "1" / "1"
    chapter.mkdir(parents=True, exist_ok=True)
    lines = []
    for n, utt_id in enumerate(sorted(wavs)):
        name = f"1-1-{n:04d}"
        wav = resample(wavs[utt_id], sample_rate, args.asr_sample_rate)
        sf.write(chapter / f"{name}.flac", wav.numpy(), args.asr_sample_rate, subtype="PCM_16")
        lines.append(f"{name} {texts[utt_id].upper()}\n")
    (chapter / "1-1.trans.txt").write_text("".join(lines))
    cmd = [sys.executable, str(RECIPES / "asr" / "decode.py"), "--checkpoint", args.asr_checkpoint,
           "--data_dir", str(out / "librispeech"), "--split", args.split, "--output", str(out / "asr")]
    print("running", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    scores = json.loads((out / "asr" / f"{args.split}-greedy.json").read_text())
    return {"asr_checkpoint": args.asr_checkpoint, "wer": scores["wer"], "cer": scores["cer"]}


def judge_transcripts(asr_out: Path, split: str, ids: list[str]) -> dict[str, tuple[str, str]]:
    """id → (reference, hypothesis) as the ASR judge scored them (`run_asr`'s <asr_out>/<split>-greedy.jsonl,
    whose utterances are 1-1-NNNN in the order of the sorted ids it was given)."""
    path = asr_out / f"{split}-greedy.jsonl"
    names = {f"1-1-{n:04d}": utt_id for n, utt_id in enumerate(sorted(ids))}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {names[r["id"]]: (r["ref"], r["hyp"]) for r in rows if r["id"] in names}


def html_report(report: Path, summary: dict, rows: list[dict], manifest, out: Path, run_dir: Path) -> None:
    """<split>.html (tools/report.py): the summary, the run's training curves, and per utterance the
    text, the synthesized audio beside the recording, mel and alignment pictures, what the ASR judge
    heard with its errors marked (where it ran), the length ratio and MCD."""
    from tools.report import command_line, error_rates, place, training_curves, write_report

    left_out = set(summary["asr_judge"]["heard"]) if "asr" in summary else set()  # not scored: not shown
    heard = judge_transcripts(out / "asr", summary["split"], [r["id"] for r in rows if r["id"] not in left_out]
                              ) if "asr" in summary else {}  # (an earlier score's transcripts are not this one's)
    recordings = {m["id"]: m["path"] for m in manifest}
    table = []
    for row in rows:
        utt_id = row["id"]
        ref, hyp = heard.get(utt_id, (None, None))
        judged = error_rates(ref, hyp) if ref is not None else {"wer": None, "cer": None, "edits": None}
        table.append({"id": utt_id, "text": row["text"],
                      "synthesized": place(out / "wavs" / f"{utt_id}.wav", report, f"audio/{utt_id}.wav"),
                      "recording": place(recordings[utt_id], report, f"audio/{utt_id}_recording{Path(recordings[utt_id]).suffix}"),
                      "mel": f"{report.stem}_files/images/{utt_id}_mel.png",
                      "alignment": f"{report.stem}_files/images/{utt_id}_alignment.png",
                      "judge": judged["edits"], "judge_wer": judged["wer"], "judge_cer": judged["cer"],
                      "length_ratio": row["length_ratio"], "mcd": row["mcd"], "mcd_vocoded": row["mcd_vocoded"]})
    curves = training_curves(run_dir / "metrics.jsonl", report)
    write_report(report, f"TTS: {summary['split']} sentences, {summary['vocoder']}", summary,
                 [("id", "id", "text"), ("text", "text", "text"), ("synthesized", "synthesized", "audio"),
                  ("recording", "recording", "audio"), ("mel", "mel: synthesized above, recording below", "image"),
                  ("alignment", "alignment: soft above, hard below", "image"),
                  ("judge", "text → what the ASR judge heard", "edits"), ("judge_wer", "judge WER", "pct"),
                  ("judge_cer", "judge CER", "pct"), ("length_ratio", "length ratio", "num"),
                  ("mcd", "MCD (dB)", "num"), ("mcd_vocoded", "MCD vocoded (dB)", "num")],
                 table, command_line(), [("training curves", curves)] if curves else [], sort="mcd")


def main():
    args = parse_config(EvalConfig)
    torch.set_grad_enabled(False)
    try:
        folder = resolve_checkpoint(args.checkpoint)  # verified (COMPLETE digests) before any file is read
        model, cfg, symbols, _ = load_tts(folder, load_config(folder, Config), checkpoint_weights(folder))
    except (UsageError, ConfigError) as e:
        refuse(str(e))
    vocoder_path = pick_vocoder(args.vocoder, folder, cfg, args.vocoder_refine_iters)  # None: Griffin-Lim
    # Beside the checkpoint, never inside: final/ and checkpoints/step_X/ are sealed (COMPLETE digests).
    out = Path(args.output) if args.output else run_dir_of(folder) / "eval" / (folder.name + ("+vocoder" if vocoder_path else ""))
    out.mkdir(parents=True, exist_ok=True)
    if args.data_dir is None and cfg.dataset_name:  # a source's run holds out no test utterances
        print(f"error: {args.checkpoint} was trained on --dataset_name {cfg.dataset_name}, which held out no test "
              f"utterances: give --data_dir (an LJSpeech-layout folder or an audiofolder of the same voice)", file=sys.stderr)
        raise SystemExit(2)
    data_dir = args.data_dir or resolve_data_dir(cfg.data_dir, args.data_cache_dir or cfg.data_cache_dir,
                                                 cfg.builtin_corpus, "ljspeech")
    # The same check and split as training (the data check's result is cached in <output>/data):
    # texts are checked against a given character table only. A derived table (--symbols auto) was
    # not a check (held-out symbols outside it were refused or dropped by --unknown_chars), and a
    # phoneme table holds phonemes, not the letters of the texts.
    fixed_table = cfg.text_frontend == "characters" and not cfg.symbols_derived
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate,
                        charset=cfg.symbols + cfg.symbols.upper() if fixed_table else None, on_bad_data=cfg.on_bad_data,
                        data_check=cfg.data_check)
    manifest = prepare_manifest(out, "all", data_dir, policy, None)
    if args.split == "all":  # a folder of new sentences (tools/corpus.py --heldout): as large as a comparison needs
        trained = tts_heard(folder, cfg, {m["id"]: m["text"] for m in manifest})
        if len(trained) == len(manifest):
            refuse(f"{folder} trained on every sentence of {data_dir}: score --split test, or give --data_dir a folder "
                   f"of sentences it never saw")
        if trained:
            print(f"{folder} trained on the sentences of {len(trained)} of the {len(manifest)} utterances of {data_dir} "
                  f"({', '.join(trained[:5])}{' ...' if len(trained) > 5 else ''}): they are not scored", flush=True)
            trained = set(trained)
            manifest = manifest.filter(lambda m: m["id"] not in trained)
    else:
        manifest = split_manifest(manifest, cfg.num_valid, cfg.num_test)[args.split]
    dataset, collate = TTSDataset(manifest, cfg), Collator(cfg)
    heard = []  # checked before any synthesis: a refusal costs nothing
    if args.asr_checkpoint and args.asr_judge_check:
        heard = judge_heard(args.asr_checkpoint, {m["id"]: m["text"] for m in manifest})
        if len(heard) == len(manifest):
            refuse(f"the ASR judge {args.asr_checkpoint} trained on every {args.split} sentence: judge with an ASR "
                   f"model trained without them (the same voice's LibriSpeech layout holds the same ids out)")
        if heard:
            print(f"the ASR judge trained on the sentences of {len(heard)} of the {len(manifest)} {args.split} "
                  f"utterances ({', '.join(heard[:5])}{' ...' if len(heard) > 5 else ''}): they are left out of "
                  f"its scores", flush=True)
    if vocoder_path:
        vocoder = neural_vocoder(vocoder_path, cfg, args.vocoder_refine_iters)
    else:
        vocoder = make_vocoder(cfg, args.griffin_lim_iters)
    frontend = mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length)
    (out / "wavs").mkdir(exist_ok=True)
    images = files_dir(out / f"{args.split}.html") / "images"
    images.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    rows, wavs, texts, floors = [], {}, {}, {}
    for i in range(len(dataset)):
        utt_id, tokens, ref = dataset[i]
        text = symbols.normalize(manifest[i]["text"])
        wav, pred, _ = synthesize(model, symbols, text, vocoder)
        sf.write(out / "wavs" / f"{utt_id}.wav", wav.numpy(), cfg.sample_rate, subtype="PCM_16")
        wavs[utt_id], texts[utt_id] = wav, text
        revocoded = frontend(wav)
        floor_wav = vocoder(ref)  # the recording's own mel, vocoded
        if args.asr_vocoder_floor:  # kept only when the judge will read them
            floors[utt_id] = floor_wav
        floor = frontend(floor_wav)
        recording = load_audio(manifest[i]["path"], cfg.sample_rate)  # the floor's reference: time-aligned
        batch = collate([dataset[i]])
        tf = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"], batch["log_prior"], False)
        hard, soft = tf["hard"][0], tf["soft"][0]  # (T, N)
        index = hard.argmax(1)  # symbol of each frame
        steps = torch.diff(index)
        rows.append({
            "id": utt_id, "text": text, "frames": ref.shape[0], "synth_frames": pred.shape[0],
            "length_ratio": pred.shape[0] / ref.shape[0],
            "mcd": mcd_dtw(pred.numpy(), ref.numpy()),
            "mcd_vocoded": mcd_dtw(revocoded.numpy(), ref.numpy()),
            "mcd_vocoder_floor": mcd_dtw(floor.numpy(), ref.numpy()),
            "pesq_vocoder_floor": wideband_pesq(recording, floor_wav, cfg.sample_rate),
            "energy_corr": envelope_correlation(pred.numpy(), ref.numpy()),
            "durations_sum_ok": int(tf["durations"][0].sum()) == ref.shape[0],
            "monotonic_ok": bool(((steps == 0) | (steps == 1)).all() and index[0] == 0
                                 and index[-1] == len(tokens) - 1 and hard.sum(1).eq(1).all()),
            "soft_peak": soft.max(1).values.mean().item(),
            "soft_hard_agreement": (soft.argmax(1) == index).float().mean().item(),
            "synth_rms_db": float(20 * np.log10(wav.pow(2).mean().sqrt().item() + 1e-9)),
        })
        # pictures of every utterance for the report (the first one's also as <id>.png beside the JSON)
        lo, hi = float(ref.min()), float(ref.max())
        big = lambda im: np.kron(im, np.ones((2, 2), np.uint8))  # noqa: E731 — 2× for reading
        pictures = {"mel": big(stack_images([to_image(pred, lo, hi), to_image(ref, lo, hi)])),
                    "alignment": big(stack_images([to_image(soft, 0, 1), to_image(hard, 0, 1)]))}
        for kind, image in pictures.items():
            write_png(images / f"{utt_id}_{kind}.png", image)
        if i == 0:
            write_png(out / f"{utt_id}.png", pictures["mel"])
            write_png(out / f"{utt_id}_alignment.png", pictures["alignment"])
    keys = ("mcd", "mcd_vocoded", "mcd_vocoder_floor", "pesq_vocoder_floor", "length_ratio", "energy_corr", "soft_peak",
            "soft_hard_agreement", "synth_rms_db")
    summary = {"checkpoint": str(folder), "split": args.split, "utterances": len(rows),
               "vocoder": vocoder_path.named if vocoder_path else f"griffin-lim ({args.griffin_lim_iters} iterations)",
               **{k: float(np.mean([r[k] for r in rows])) for k in keys},
               "durations_sum_ok": sum(r["durations_sum_ok"] for r in rows),
               "monotonic_ok": sum(r["monotonic_ok"] for r in rows),
               "seconds": round(time.monotonic() - start, 1)}
    if args.asr_checkpoint:
        unheard = {i: wav for i, wav in wavs.items() if i not in heard}
        summary["asr_judge"] = {"checked": args.asr_judge_check, "heard": heard, "scored": len(unheard)}
        summary["asr"] = run_asr(args, unheard, texts, cfg.sample_rate, out)
        if args.asr_recordings:
            recordings = {m["id"]: load_audio(m["path"], cfg.sample_rate) for m in manifest if m["id"] in unheard}
            summary["asr_recordings"] = run_asr(args, recordings, texts, cfg.sample_rate, out / "recordings")
        if args.asr_vocoder_floor:
            floors = {i: wav for i, wav in floors.items() if i in unheard}
            summary["asr_vocoder_floor"] = run_asr(args, floors, texts, cfg.sample_rate, out / "vocoder_floor")
    with open(out / f"{args.split}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (out / f"{args.split}.json").write_text(json.dumps(summary, indent=1) + "\n")
    html_report(out / f"{args.split}.html", summary, rows, manifest, out, run_dir_of(folder))
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    run_main(main)  # its exit skips the last garbage collection (seconds): common.training.faults
