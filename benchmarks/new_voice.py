"""A new voice on a fresh machine: each plain command's wall time, the built-in base's part apart, and the quality.

    python benchmarks/new_voice.py --voice data/prompts_fr --lang fr --out runs/new_voice_fr
    python -m tools.corpus --profile tiny --out /tmp/tiny_voice      # a tiny voice (both layouts), seconds
    python benchmarks/new_voice.py --voice /tmp/tiny_voice --lang en-us --out /tmp/nv --smoke   # ~1 min

`--voice` is a folder as `python -m tools.real_prompts --lang fr --out data/prompts_fr` writes it:
`librispeech/` for ASR, `ljspeech/` for TTS, `prompts.tsv` (its validation and test counts give TTS's
`--num_valid` / `--num_test`, so both recipes hold out the same prompts; without it, the recipe's own).
The commands run one after another, each alone, as a user types them (README, "your data"; through
`python -m accelerate.commands.launch`, which is `accelerate launch`):

    accelerate launch recipes/asr/train.py --data_dir <voice>/librispeech --output_dir <out>/asr
    accelerate launch recipes/asr/decode.py --checkpoint <out>/asr --split test         # held-out CER / WER
    accelerate launch recipes/tts/train.py --data_dir <voice>/ljspeech --phonemizer_language <lang> \
        --num_valid V --num_test T --output_dir <out>/tts
    python recipes/tts/score.py --checkpoint <out>/tts --split test --asr_checkpoint <out>/asr   # judge, MCD

From an EMPTY cache: `$SPEECH_RECIPES_CACHE` is a new temporary folder (deleted at the end), so the
built-in corpus and each recipe's built-in base are made from scratch inside the training commands,
as on a fresh machine. `--keep_cache` uses the machine's cache as it is instead (a base trained before
costs nothing: not a fresh-machine figure, and the output says so).

A training command's time is split from its log and the cache's markers: the base starts at the line
"the built-in base: training it once for this machine into <folder>" and ends at <folder>/.complete's
mtime; the built-in corpus, when that base made it, ends at the corpus folder's .complete (its part
includes the base child's start-up, ~10 s). The voice's part is the rest (its data check, features,
training, export). Writes <out>/new_voice.json (commands, times, CER/WER, judge ratio, MCD, machine),
<out>/logs/<step>.log, and prints one markdown table row.

`--smoke` checks the pipeline, not the figures: the tiny built-in corpus (`--builtin_corpus tiny`), a
tiny model, 2 voice steps, bases of 3 steps (a `--base_config` written to <out>). Arguments after `--`
go to both training commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]  # `accelerate launch`, from this environment
BASE_LINE = re.compile(r"the built-in base: training it once for this machine into (\S+) ")
THREADS = re.compile(r"(\d+) thread\(s\) per process")

# --smoke: the tests' tiny sizes (tests/recipes/test_asr.py, test_tts.py), bases of 3 steps.
SMOKE_COMMON = ["--builtin_corpus", "tiny", "--max_steps", "2", "--save_steps", "2", "--warmup_steps", "5",
                "--max_batch_seconds", "16", "--stats_utterances", "20", "--report_to", "none"]
SMOKE = {"asr": ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64",
                 "--conv_kernel", "7", "--eval_steps", "0", "--early_stopping_patience", "0"],
         "tts": ["--dim", "32", "--ffn_dim", "64", "--duration_channels", "32", "--attention_dim", "32",
                 "--num_heads", "2", "--binarization_start_steps", "3", "--learning_rate", "3e-3"]}
SMOKE_BASE = {"asr": "max_steps: 3\nwarmup_steps: 5\nmax_batch_seconds: 16\nstats_utterances: 20\nsave_steps: 2\n"
                     "logging_steps: 1\neval_steps: 0\n",
              "tts": "num_valid: 2\nnum_test: 2\nmax_steps: 3\nwarmup_steps: 5\nmax_batch_seconds: 16\n"
                     "stats_utterances: 20\nsave_steps: 2\nlogging_steps: 1\n"}


def held_out(voice: Path, smoke: bool) -> list[str]:
    """TTS's --num_valid / --num_test: prompts.tsv's validation and test counts (tools/real_prompts.py:
    the ljspeech ids are sorted train, validation, test), else none (the recipe's 20 / 20; 2 / 2 in a smoke)."""
    tsv = voice / "prompts.tsv"
    if not tsv.is_file():
        return ["--num_valid", "2", "--num_test", "2"] if smoke else []
    rows = [line.split("\t") for line in tsv.read_text(encoding="utf-8").splitlines()]
    col = rows[0].index("split")
    splits = [r[col] for r in rows[1:]]
    return ["--num_valid", str(splits.count("validation")), "--num_test", str(splits.count("test"))]


def timed(name: str, cmd: list[str], shown: str, env: dict, logs: Path) -> dict:
    """Run `cmd` alone, its output into logs/<name>.log with each line's arrival time; the wall time,
    split into the built-in base's part (and the corpus's, when that base made it) and the rest."""
    print(f"$ {shown}", flush=True)
    lines, start = [], time.time()
    with open(logs / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines.append((time.time(), line))
            log.write(line)
        returncode = proc.wait()
    end = time.time()
    if returncode != 0:
        tail = "".join(line for _, line in lines[-15:])
        raise SystemExit(f"new_voice: `{shown}` failed (exit {returncode}); its log: {logs / name}.log\n{tail}")
    result = {"command": shown, "seconds": round(end - start, 1)}
    threads = [m.group(1) for _, line in lines for m in [THREADS.search(line)] if m]
    if threads:
        result["torch_threads"] = int(threads[-1])  # the voice's run: the last (a base's child logs first)
    base = next(((t, Path(m.group(1))) for t, line in lines for m in [BASE_LINE.search(line)] if m), None)
    if base:
        base_start, folder = base
        base_end = (folder / ".complete").stat().st_mtime
        result["base_seconds"] = round(base_end - base_start, 1)
        result["voice_seconds"] = round(end - start - (base_end - base_start), 1)
        corpus = [p / ".complete" for p in folder.parent.glob("espeak_corpus-*") if (p / ".complete").is_file()]
        made = [p.stat().st_mtime for p in corpus if base_start <= p.stat().st_mtime <= base_end]
        if made:  # this base's child generated the built-in corpus first
            result["corpus_seconds"] = round(max(made) - base_start, 1)
            result["base_seconds"] = round(base_end - max(made), 1)
    else:
        result["voice_seconds"] = result["seconds"]
    print(f"  {result}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--voice", required=True, type=Path, help="a tools/real_prompts.py folder (librispeech/, ljspeech/)")
    ap.add_argument("--lang", required=True, help="TTS --phonemizer_language (fr, es, it, ru, en-us)")
    ap.add_argument("--out", required=True, type=Path, help="runs, logs and new_voice.json go here")
    ap.add_argument("--only", choices=["asr", "tts"], help="one recipe (tts still needs <out>/asr as its judge)")
    ap.add_argument("--keep_cache", action="store_true", help="the machine's cache as it is: not a fresh-machine figure")
    ap.add_argument("--smoke", action="store_true", help="tiny corpus, model and steps: the pipeline, not the figures")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    voice, out = args.voice.resolve(), args.out.resolve()
    for layout in ("librispeech", "ljspeech"):
        if not (voice / layout).is_dir():
            raise SystemExit(f"new_voice: --voice {voice} has no {layout}/: make one with "
                             f"`python -m tools.real_prompts --lang fr --out data/prompts_fr` (docs/data.md)")
    todo = [args.only] if args.only else ["asr", "tts"]
    if "asr" not in todo and not (out / "asr" / "final").is_dir():
        raise SystemExit(f"new_voice: --only tts needs the ASR judge {out / 'asr'}: run --only asr (or both) first")
    for recipe in todo:
        if (out / recipe).exists():
            raise SystemExit(f"new_voice: {out / recipe} exists (a run there would resume, not start): "
                             f"choose another --out or delete it")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a fresh shell
    env["PYTHONUNBUFFERED"] = "1"  # each line reaches us when written: its arrival time is when it happened
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cache = None if args.keep_cache else Path(tempfile.mkdtemp(prefix="new_voice_cache_"))
    if cache:
        env["SPEECH_RECIPES_CACHE"] = str(cache)
    cache_note = (f"empty at the start ({cache}, deleted at the end): corpus and bases made from scratch"
                  if cache else "the machine's cache, as it was (--keep_cache): NOT a fresh-machine figure")
    print(f"new_voice: cache {cache_note}", flush=True)

    def small(recipe: str) -> list[str]:  # --smoke's settings for one recipe, its base's YAML beside the runs
        if not args.smoke:
            return []
        (out / f"smoke_base_{recipe}.yaml").write_text(SMOKE_BASE[recipe])
        return [*SMOKE_COMMON, *SMOKE[recipe], "--base_config", str(out / f"smoke_base_{recipe}.yaml")]

    steps = {}
    try:
        if "asr" in todo:
            cli = ["--data_dir", f"{voice}/librispeech", "--output_dir", f"{out}/asr", *small("asr"), *extra]
            steps["asr_train"] = timed("asr_train", [*LAUNCH, "recipes/asr/train.py", *cli], env=env, logs=logs,
                                       shown=" ".join(["accelerate launch recipes/asr/train.py", *cli]))
            cli = ["--checkpoint", f"{out}/asr", "--split", "test"]
            steps["asr_decode"] = timed("asr_decode", [*LAUNCH, "recipes/asr/decode.py", *cli], env=env, logs=logs,
                                        shown=" ".join(["accelerate launch recipes/asr/decode.py", *cli]))
        if "tts" in todo:
            cli = ["--data_dir", f"{voice}/ljspeech", "--phonemizer_language", args.lang,
                   *held_out(voice, args.smoke), "--output_dir", f"{out}/tts", *small("tts"), *extra]
            steps["tts_train"] = timed("tts_train", [*LAUNCH, "recipes/tts/train.py", *cli], env=env, logs=logs,
                                       shown=" ".join(["accelerate launch recipes/tts/train.py", *cli]))
            cli = ["--checkpoint", f"{out}/tts", "--split", "test", "--asr_checkpoint", f"{out}/asr"]
            steps["tts_score"] = timed("tts_score", [sys.executable, "recipes/tts/score.py", *cli], env=env, logs=logs,
                                       shown=" ".join(["python recipes/tts/score.py", *cli]))
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    report(args, out, steps, cache_note)


def report(args, out: Path, steps: dict, cache_note: str) -> None:
    """<out>/new_voice.json and one markdown table row: times in minutes, CER/WER in %, judge ratio, MCD in dB."""
    quality = {}
    if "asr_decode" in steps:
        asr = json.loads((out / "asr" / "decode" / "final" / "test-greedy.json").read_text())
        quality.update(asr_cer=asr["cer"], asr_wer=asr["wer"])
    if "tts_score" in steps:
        tts = json.loads((out / "tts" / "eval" / "final" / "test.json").read_text())
        judge, recordings = tts["asr"]["cer"], tts["asr_recordings"]["cer"]
        quality.update(judge_cer=judge, recordings_cer=recordings, mcd=tts["mcd"], length_ratio=tts["length_ratio"],
                       judge_ratio=judge / recordings if recordings else None)
    threads = next((s["torch_threads"] for s in steps.values() if "torch_threads" in s), None)
    result = {"voice": str(args.voice), "lang": args.lang, "smoke": args.smoke, "cache": cache_note,
              "fresh_machine": not args.keep_cache, "steps": steps, "quality": quality,
              "machine": {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
                          "torch_threads": threads, "date": datetime.datetime.now().isoformat(timespec="seconds")}}
    (out / "new_voice.json").write_text(json.dumps(result, indent=1) + "\n")

    minutes = lambda step, key: f"{steps[step][key] / 60:.1f}" if key in steps.get(step, {}) else "–"  # noqa: E731
    pct = lambda key: f"{100 * quality[key]:.1f} %" if quality.get(key) is not None else "–"  # noqa: E731
    ratio = f"{quality['judge_ratio']:.2f} ×" if quality.get("judge_ratio") else "–"
    mcd = f"{quality['mcd']:.2f} dB" if "mcd" in quality else "–"
    print(f"\nwrote {out / 'new_voice.json'}; cache: {cache_note}"
          + ("; --smoke: a pipeline check, not a measurement" if args.smoke else ""))
    print("| voice | ASR train min: corpus / base / voice | ASR decode min | test CER (WER) | TTS train min: "
          "corpus / base / voice | TTS score min | judge ratio | MCD |\n|---|---|---|---|---|---|---|---|")
    print(f"| {args.voice.name} ({args.lang}) | {minutes('asr_train', 'seconds')}: {minutes('asr_train', 'corpus_seconds')}"
          f" / {minutes('asr_train', 'base_seconds')} / {minutes('asr_train', 'voice_seconds')} | "
          f"{minutes('asr_decode', 'seconds')} | {pct('asr_cer')} ({pct('asr_wer')}) | {minutes('tts_train', 'seconds')}: "
          f"{minutes('tts_train', 'corpus_seconds')} / {minutes('tts_train', 'base_seconds')} / "
          f"{minutes('tts_train', 'voice_seconds')} | "
          f"{minutes('tts_score', 'seconds')} | {ratio} | {mcd} |")


if __name__ == "__main__":
    main()
