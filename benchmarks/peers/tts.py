"""TTS at an equal wall-clock budget: our recipe against Coqui TTS's Glow-TTS recipe, same voice, same
held-out sentences, same judge. A results script (CI never runs it); comparison 3 of benchmarks/RESULTS.md.

    python -m venv .coqui && .coqui/bin/pip install coqui-tts==0.28.0 six torch==2.14.1 torchaudio==2.11.0 torchcodec==0.17.0
    apt-get install espeak-ng ffmpeg                                  # Coqui's phonemizer and audio decoding
    python benchmarks/peers/tts.py train --system coqui --coqui_python .coqui/bin/python \
        --data_dir data/prompts_es/ljspeech --language es --num_valid 48 --num_test 52 \
        --asr_checkpoint outputs/asr_es --out runs/peers/tts-es-coqui
    python benchmarks/peers/tts.py train --system ours --data_dir data/prompts_es/ljspeech --language es \
        --num_valid 48 --num_test 52 --asr_checkpoint outputs/asr_es --out runs/peers/tts-es-ours
    python benchmarks/peers/tts.py score --system NAME --wavs DIR --data_dir ... --num_valid 48 --num_test 52 \
        --asr_checkpoint outputs/asr_es --out runs/peers/tts-es-NAME     # any system's <id>.wav of the held-out sentences
    python benchmarks/peers/tts.py report runs/peers/tts-es-*

Each system trains from scratch on the voice's training sentences (our recipe's split: sorted ids,
the last --num_test held out for testing, the --num_valid before them for validation) for --minutes
of wall time from its launch (start-up, data preparation and validation count), with --threads torch
threads and no data-loading worker processes, then synthesizes the held-out sentences from text with
its own Griffin-Lim (60 iterations both). Scored by one code, ours (recipes/tts/score.py's functions):
the ASR judge's CER on the synthesized sentences and on the recordings (the judge must not have trained
on them: checked as score.py checks it), the length ratio synthesized / recorded (median, worst decile,
how many under 0.8) and MCD of the re-analysed log-mel against the recording's (score.py's `mcd_vocoded`).

- ours: `accelerate launch recipes/tts/train.py` with the settings a new voice takes in
  recipes/tts/README.md (phonemes of --language, `--symbols auto --unknown_chars drop --max_seconds 30`)
  and its defaults otherwise, from scratch (`--init_from none`: the peers start from nothing either);
  at the budget SIGTERM (the recipe saves the step it is in),
  its last checkpoint (its weight average) synthesizes.
- coqui: peers/coqui_glowtts.py in Coqui's own environment (what it changes in their recipe, and why:
  its docstring); `--coqui_variant small`: at our model's size and warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace


HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from asr import (CpuMeter, end_session, git_commit, launch, load_results, thread_env, wait_metered,  # noqa: E402
                 with_flags)


def refuse(msg: str) -> None:
    sys.exit(f"tts.py: {msg}")


def heldout(data_dir: Path, out: Path, num_valid: int, num_test: int):
    """Our recipe's split of the voice (the data check and sort training does) and its config."""
    sys.path.insert(0, str(ROOT / "recipes" / "tts"))
    sys.path.insert(1, str(ROOT))
    from common.config import parse_config
    from common.data.manifest import DataPolicy, prepare_manifest, split_manifest
    from train import Config

    cfg = parse_config(Config, ["--data_dir", str(data_dir), "--max_seconds", "30", "--text_frontend", "characters"],
                       default_yaml=ROOT / "recipes" / "tts" / "config.yaml")
    policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate, charset=None,
                        on_bad_data=cfg.on_bad_data, data_check=cfg.data_check)
    return split_manifest(prepare_manifest(out / "data", "all", data_dir, policy, None), num_valid, num_test), cfg


def train_ours(args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "recipes/tts/train.py", "--output_dir", str(out / "train"),
           "--data_dir", str(args.data_dir), "--num_valid", str(args.num_valid), "--num_test", str(args.num_test),
           "--max_seconds", "30", "--symbols", "auto", "--unknown_chars", "drop", "--text_frontend", "phonemes",
           "--phonemizer_language", args.language, "--init_from", "none", "--max_steps", "1000000",
           "--num_threads", str(args.threads),
           "--report_to", "none"]
    cmd = with_flags(cmd, args.ours_args)  # in place of the flags above that it sets
    env = thread_env(str(args.threads)) | {"PYTHONPATH": str(ROOT)}
    proc, t0 = launch(cmd, ROOT, env, out / "train.log")
    deadline, meter = t0 + 60 * args.minutes, CpuMeter(proc.pid)
    wait_metered(proc, deadline, meter)
    if proc.poll() is not None:
        refuse(f"ours ended before the budget (exit {proc.returncode}); see {out / 'train.log'}")
    os.killpg(proc.pid, signal.SIGTERM)  # the preemption path: it saves the step it is in, then exits
    wait_metered(proc, deadline + 300, meter, until_group_ends=True)
    end_session(proc)
    last = sorted((out / "train" / "checkpoints").glob("step_*/COMPLETE"))[-1].parent
    score = out / "score"
    subprocess.run([sys.executable, "recipes/tts/score.py", "--checkpoint", str(last), "--split", "test",
                    "--output", str(score)], cwd=ROOT, env=env, check=True, capture_output=True)
    return {"wavs": str(score / "wavs"), "optimizer_steps": int(last.name[5:]),
            "minutes": round((last.stat().st_mtime - t0) / 60, 2), "train_cpu_s": round(meter.seconds),
            "version": f"this repository @ {git_commit(ROOT)}"}


def train_coqui(args, out: Path, split) -> dict:
    data = out / "coqui_data"
    data.mkdir()
    (data / "wavs").symlink_to(Path(args.data_dir).resolve() / "wavs")
    for name in ("train", "validation"):  # LJSpeech metadata lines; the text as our recipe reads it
        (data / f"{name}.csv").write_text("".join(f"{r['id']}|{r['text']}|{r['text']}\n" for r in split[name]))
    (data / "test.jsonl").write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n" for r in split["test"]))
    cmd = [args.coqui_python, str(HERE / "coqui_glowtts.py"), "--data", str(data), "--out", str(out / "coqui"),
           "--minutes", str(args.minutes), "--threads", str(args.threads), "--language", args.language,
           "--variant", args.coqui_variant]
    proc, t0 = launch(cmd, ROOT, thread_env(str(args.threads)), out / "train.log")
    meter = CpuMeter(proc.pid)
    wait_metered(proc, t0 + 60 * args.minutes + 1800, meter)  # + the step in flight and the synthesis
    end_session(proc)
    if proc.returncode != 0:
        refuse(f"coqui ended with exit {proc.returncode}; see {out / 'train.log'}")
    done = json.loads((out / "coqui" / "result.json").read_text())
    version = subprocess.run([args.coqui_python, "-c", "import TTS; print(TTS.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    return {"wavs": str(out / "coqui" / "wavs"), "optimizer_steps": done["optimizer_steps"], "minutes": done["minutes"],
            "parameters": done["parameters"], "variant": args.coqui_variant,
            "train_cpu_s": round(meter.seconds), "version": f"coqui-tts {version}, Glow-TTS (recipes/ljspeech/glow_tts)"}


def score(args, out: Path, split, cfg, wavs: Path) -> dict:
    """One scoring for every system: score.py's functions on the wav files each one wrote."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "recipes" / "tts"))
    from audio import mcd_dtw, mel_frontend
    from common.data.loading import load_audio
    from score import judge_heard, run_asr

    frontend = mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length)
    rows, synth, texts = [], {}, {}
    for r in split["test"]:
        wav, rec = load_audio(str(wavs / f"{r['id']}.wav"), cfg.sample_rate), load_audio(r["path"], cfg.sample_rate)
        # a model early in training may say almost nothing: silence up to one analysis window is scored as such
        wav = torch.nn.functional.pad(wav, (0, max(0, cfg.win_length - len(wav))))
        pred, ref = frontend(wav), frontend(rec)
        rows.append({"id": r["id"], "length_ratio": pred.shape[0] / ref.shape[0],
                     "mcd_vocoded": mcd_dtw(pred.numpy(), ref.numpy())})
        synth[r["id"]], texts[r["id"]] = wav, r["text"]
    heard = judge_heard(args.asr_checkpoint, texts)
    unheard = sorted(set(synth) - set(heard))
    how = SimpleNamespace(split="test", asr_sample_rate=16000, asr_checkpoint=args.asr_checkpoint)
    asr = run_asr(how, {i: synth[i] for i in unheard}, texts, cfg.sample_rate, out / "judge")
    recordings = {r["id"]: load_audio(r["path"], cfg.sample_rate) for r in split["test"] if r["id"] in unheard}
    asr_rec = run_asr(how, recordings, texts, cfg.sample_rate, out / "judge_recordings")
    ratios = np.array([r["length_ratio"] for r in rows])
    (out / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"utterances": len(rows), "judge_scored": len(unheard), "cer": asr["cer"], "wer": asr["wer"],
            "cer_recordings": asr_rec["cer"], "cer_ratio": asr["cer"] / asr_rec["cer"],
            "mcd_vocoded": float(np.mean([r["mcd_vocoded"] for r in rows])),
            "length_median": float(np.median(ratios)), "length_worst_decile": float(np.quantile(ratios, 0.1)),
            "under_0_8": int((ratios < 0.8).sum())}


def train(args) -> None:
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        refuse(f"{out} is not empty; give a new --out")
    if args.system == "ours" and args.coqui_variant != "shipped":
        refuse("--coqui_variant is Coqui's model; for ours give train.py flags with --ours_args")
    if args.system == "coqui" and args.ours_args:
        refuse("--ours_args are our train.py's flags; Coqui's model is chosen with --coqui_variant")
    if args.system == "coqui" and not Path(args.coqui_python).is_file():
        refuse(f"--coqui_python {args.coqui_python} does not exist; install Coqui TTS as this file's header says")
    out.mkdir(parents=True, exist_ok=True)
    split, cfg = heldout(Path(args.data_dir).resolve(), out, args.num_valid, args.num_test)
    run = train_ours(args, out) if args.system == "ours" else train_coqui(args, out, split)
    result = {"system": args.system, "data": str(args.data_dir), "threads": args.threads, "minutes_budget": args.minutes,
              "command": " ".join(sys.argv), **run, **score(args, out, split, cfg, Path(run["wavs"]))}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def score_only(args) -> None:
    """Any system's synthesis of the held-out sentences (a folder of <id>.wav), scored as `train` scores."""
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        refuse(f"{out} is not empty; give a new --out")
    out.mkdir(parents=True, exist_ok=True)
    split, cfg = heldout(Path(args.data_dir).resolve(), out, args.num_valid, args.num_test)
    missing = [r["id"] for r in split["test"] if not (Path(args.wavs) / f"{r['id']}.wav").is_file()]
    if missing:
        refuse(f"{args.wavs} lacks {len(missing)} of the {len(split['test'])} held-out sentences ({', '.join(missing[:3])} ...): "
               "synthesize every one (same --num_valid/--num_test as the training's)")
    result = {"system": args.system, "data": str(args.data_dir), "command": " ".join(sys.argv), "wavs": args.wavs,
              **score(args, out, split, cfg, Path(args.wavs))}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def report(args) -> None:
    results = load_results(args.runs)
    print("| system | steps in the budget | ASR CER synthesized / recordings | ratio | length median / worst decile "
          "(under 0.8) | MCD | training CPU-min | version |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        steps = f"{r['optimizer_steps']} ({r['minutes_budget']:g} min)" if "optimizer_steps" in r else "–"
        cpu = f"{r['train_cpu_s'] / 60:.0f}" if "train_cpu_s" in r else "–"
        name = r["system"] + (f" ({r['variant']})" if r.get("variant", "shipped") != "shipped" else "")
        print(f"| {name} | {steps} | {100 * r['cer']:.1f} / "
              f"{100 * r['cer_recordings']:.1f} % | {r['cer_ratio']:.2f} × | {r['length_median']:.3f} / "
              f"{r['length_worst_decile']:.3f} ({r['under_0_8']} of {r['utterances']}) | {r['mcd_vocoded']:.2f} | "
              f"{cpu} | {r.get('version', '–')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one system for the budget, synthesize the held-out sentences, score them")
    t.add_argument("--system", choices=["ours", "coqui"], required=True)
    t.add_argument("--data_dir", required=True, help="the voice, LJSpeech layout")
    t.add_argument("--language", required=True, help="espeak-ng language of the phonemizer (both systems)")
    t.add_argument("--num_valid", type=int, default=20)
    t.add_argument("--num_test", type=int, default=20)
    t.add_argument("--asr_checkpoint", required=True, help="the judge: an ASR run on the same voice's training sentences")
    t.add_argument("--minutes", type=float, default=30.0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--coqui_python", default=".coqui/bin/python", help="Coqui TTS's interpreter (its own venv)")
    t.add_argument("--coqui_variant", choices=["shipped", "small"], default="shipped",
                   help="coqui: the recipe's model, or at our size and warm-up (coqui_glowtts.py's docstring)")
    t.add_argument("--ours_args", default="", help="ours: more train.py flags (in place of the script's own)")
    t.add_argument("--out", required=True, help="a new folder for this run")
    c = sub.add_parser("score", help="score a folder of <id>.wav (any system's synthesis of the held-out sentences)")
    c.add_argument("--wavs", required=True, help="one <id>.wav per held-out sentence")
    c.add_argument("--system", required=True, help="the name the report gives it")
    for name in ("--data_dir", "--asr_checkpoint", "--out"):
        c.add_argument(name, required=True)
    c.add_argument("--num_valid", type=int, default=20)
    c.add_argument("--num_test", type=int, default=20)
    r = sub.add_parser("report", help="markdown table of finished runs")
    r.add_argument("runs", nargs="+", help="--out folders of `train`, or their result.json files")
    args = parser.parse_args()
    {"train": train, "score": score_only, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
