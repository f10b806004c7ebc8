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
    python recipes/tts/score.py --checkpoint <out>/tts --split test --asr_checkpoint <out>/asr \
        --vocoder griffin_lim                                                       # judge, MCD, PESQ
    accelerate launch recipes/vocoder/train.py --tts_run <out>/tts                  # the voice's vocoder
    python recipes/tts/score.py --checkpoint <out>/tts --split test --asr_checkpoint <out>/asr   # through it

Each training command from an EMPTY cache of its own: `$SPEECH_RECIPES_CACHE` is a new folder per
recipe (<cache>/asr, <cache>/tts, <cache>/vocoder), so the built-in corpus and the recipe's built-in
base are made from scratch inside that command, as if it were the first on a fresh machine. <cache> is
a temporary folder deleted at the end, or `--cache DIR` (a folder that must not exist yet, kept: the
bases stay, and `--builtin_chain` scores the built-in voice's own chain from them: the TTS base through
the vocoder base and through Griffin-Lim, the ASR base as the judge). `--keep_cache` uses the
machine's cache as it is instead (a base trained before costs nothing: not a fresh-machine figure, and
the output says so).

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
RECIPES = ["asr", "tts", "vocoder"]
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
SMOKE["vocoder"] = ["--dim", "16", "--hidden_dim", "32", "--layers", "1", "--periods", "2,3", "--period_channels",
                    "4,4", "--resolutions", "256,512", "--resolution_channels", "4", "--segment_frames", "12"]
SMOKE_BASE = {"vocoder": "num_valid: 2\nnum_test: 2\nmax_steps: 3\nmax_batch_seconds: 16\nsave_steps: 2\nlogging_steps: 1\n",
              "asr": "max_steps: 3\nwarmup_steps: 5\nmax_batch_seconds: 16\nstats_utterances: 20\nsave_steps: 2\n"
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
    with open(logs / f"{name}.log", "w", buffering=1) as log:  # line-buffered: the log can be watched
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


def score(name: str, cli: list[str], output: Path, env: dict, logs: Path) -> dict:
    """`score.py --checkpoint cli[0] --split test cli[1:]`, timed; `output`: the folder it writes
    (score.py's default for the run and vocoder, or its --output), whose test.json is read back."""
    cli = ["--checkpoint", cli[0], "--split", "test", *cli[1:]]
    result = timed(name, [sys.executable, "recipes/tts/score.py", *cli], env=env, logs=logs,
                   shown=" ".join(["python recipes/tts/score.py", *cli]))
    return {**result, "scores": str(output / "test.json")}


def base_of(cache: Path, prefix: str) -> Path:
    """The training run of the one built-in base `prefix`-<digest> in a recipe's cache (--builtin_chain):
    its <digest>.run/ folder, which keeps final/ and the data manifests (what a judge trained on)."""
    found = sorted(p for p in cache.glob(f"{prefix}-*.run") if (p / "final").is_dir())
    if len(found) != 1:
        raise SystemExit(f"new_voice: --builtin_chain: {len(found)} built-in base runs {prefix}-*.run in {cache}, not one")
    return found[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--voice", required=True, type=Path, help="a tools/real_prompts.py folder (librispeech/, ljspeech/)")
    ap.add_argument("--lang", required=True, help="TTS --phonemizer_language (fr, es, it, ru, en-us)")
    ap.add_argument("--out", required=True, type=Path, help="runs, logs and new_voice.json go here")
    ap.add_argument("--only", choices=RECIPES, help="one recipe (tts and vocoder need <out>/asr as their judge, "
                    "vocoder needs <out>/tts)")
    ap.add_argument("--keep_cache", action="store_true", help="the machine's cache as it is: not a fresh-machine figure")
    ap.add_argument("--cache", type=Path, help="the empty caches go here, kept (default: a temporary folder, deleted)")
    ap.add_argument("--builtin_chain", action="store_true", help="also score the built-in voice's TTS base through "
                    "the vocoder base and Griffin-Lim (needs all three recipes in this call, and --cache)")
    ap.add_argument("--smoke", action="store_true", help="tiny corpus, model and steps: the pipeline, not the figures")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    voice, out = args.voice.resolve(), args.out.resolve()
    for layout in ("librispeech", "ljspeech"):
        if not (voice / layout).is_dir():
            raise SystemExit(f"new_voice: --voice {voice} has no {layout}/: make one with "
                             f"`python -m tools.real_prompts --lang fr --out data/prompts_fr` (docs/data.md)")
    todo = [args.only] if args.only else RECIPES
    if "asr" not in todo and not (out / "asr" / "final").is_dir():
        raise SystemExit(f"new_voice: --only {args.only} needs the ASR judge {out / 'asr'}: run --only asr (or all) first")
    if "vocoder" in todo and "tts" not in todo and not (out / "tts" / "final").is_dir():
        raise SystemExit(f"new_voice: --only vocoder needs the TTS run {out / 'tts'}: run --only tts first")
    if args.builtin_chain and (args.only or not args.cache or args.keep_cache):
        raise SystemExit("new_voice: --builtin_chain scores the bases this call trains: give --cache DIR, "
                         "without --only or --keep_cache")
    if args.cache and (args.keep_cache or args.cache.exists()):
        raise SystemExit(f"new_voice: --cache {args.cache}: give a folder that does not exist yet "
                         f"(and not with --keep_cache): its caches must start empty")
    for recipe in todo:
        if (out / recipe).exists():
            raise SystemExit(f"new_voice: {out / recipe} exists (a run there would resume, not start): "
                             f"choose another --out or delete it")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a fresh shell
    env["PYTHONUNBUFFERED"] = "1"  # each line reaches us when written: its arrival time is when it happened
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cache = None if args.keep_cache else args.cache.resolve() if args.cache else Path(
        tempfile.mkdtemp(prefix="new_voice_cache_"))
    kept = "kept" if args.cache else "deleted at the end"
    cache_note = (f"each training command's own, empty at its start ({cache}/<recipe>, {kept}): corpus and base "
                  f"made from scratch in each" if cache
                  else "the machine's cache, as it was (--keep_cache): NOT a fresh-machine figure")

    def env_of(recipe: str) -> dict:  # the recipe's own empty cache, or the machine's
        if not cache:
            return env
        (cache / recipe).mkdir(parents=True, exist_ok=True)
        return {**env, "SPEECH_RECIPES_CACHE": str(cache / recipe)}
    print(f"new_voice: cache {cache_note}", flush=True)

    def small(recipe: str) -> list[str]:  # --smoke's settings for one recipe, its base's YAML beside the runs
        if not args.smoke:
            return []
        (out / f"smoke_base_{recipe}.yaml").write_text(SMOKE_BASE[recipe])
        common = SMOKE_COMMON if recipe != "vocoder" else [  # it has no feature statistics
            a for a in SMOKE_COMMON if a not in ("--stats_utterances", "20")]
        return [*common, *SMOKE[recipe], "--base_config", str(out / f"smoke_base_{recipe}.yaml")]

    steps = {}
    judge = ["--asr_checkpoint", f"{out}/asr"]
    try:
        if "asr" in todo:
            cli = ["--data_dir", f"{voice}/librispeech", "--output_dir", f"{out}/asr", *small("asr"), *extra]
            steps["asr_train"] = timed("asr_train", [*LAUNCH, "recipes/asr/train.py", *cli], env=env_of("asr"),
                                       logs=logs, shown=" ".join(["accelerate launch recipes/asr/train.py", *cli]))
            cli = ["--checkpoint", f"{out}/asr", "--split", "test"]
            steps["asr_decode"] = timed("asr_decode", [*LAUNCH, "recipes/asr/decode.py", *cli], env=env, logs=logs,
                                        shown=" ".join(["accelerate launch recipes/asr/decode.py", *cli]))
        if "tts" in todo:
            cli = ["--data_dir", f"{voice}/ljspeech", "--phonemizer_language", args.lang,
                   *held_out(voice, args.smoke), "--output_dir", f"{out}/tts", *small("tts"), *extra]
            steps["tts_train"] = timed("tts_train", [*LAUNCH, "recipes/tts/train.py", *cli], env=env_of("tts"),
                                       logs=logs, shown=" ".join(["accelerate launch recipes/tts/train.py", *cli]))
            steps["tts_score_gl"] = score("tts_score_gl", [f"{out}/tts", *judge, "--vocoder", "griffin_lim"],
                                          out / "tts" / "eval" / "final", env, logs)
        if "vocoder" in todo:
            cli = ["--tts_run", f"{out}/tts", *small("vocoder"), *extra]
            steps["vocoder_train"] = timed("vocoder_train", [*LAUNCH, "recipes/vocoder/train.py", *cli],
                                           env=env_of("vocoder"), logs=logs,
                                           shown=" ".join(["accelerate launch recipes/vocoder/train.py", *cli]))
            steps["tts_score"] = score("tts_score", [f"{out}/tts", *judge],  # auto: the run's own vocoder
                                       out / "tts" / "eval" / "final+vocoder", env, logs)
        if args.builtin_chain:
            tts_base, asr_base = base_of(cache / "tts", "tts_base"), base_of(cache / "asr", "asr_base")
            vocoder_base = base_of(cache / "vocoder", "vocoder_base")
            for name, vocoder in (("builtin_score_gl", "griffin_lim"), ("builtin_score", str(vocoder_base))):
                steps[name] = score(name, [str(tts_base), "--asr_checkpoint", str(asr_base), "--vocoder", vocoder,
                                           "--output", f"{out}/builtin/{name}"], out / "builtin" / name,
                                    env_of("tts"), logs)  # the built-in corpus: in the TTS command's cache
    finally:
        if cache and not args.cache:
            shutil.rmtree(cache, ignore_errors=True)
    report(args, out, steps, cache_note)


def report(args, out: Path, steps: dict, cache_note: str) -> None:
    """<out>/new_voice.json and one markdown table row: times in minutes, CER/WER in %, judge ratio, MCD in dB.
    With --only, the steps an earlier call wrote there for the same voice are kept beside this call's."""
    earlier = out / "new_voice.json"
    if args.only and earlier.is_file():
        before = json.loads(earlier.read_text())
        if (before.get("voice"), before.get("lang"), before.get("smoke")) == (str(args.voice), args.lang, args.smoke):
            steps = {**{k: v for k, v in before["steps"].items() if k not in steps}, **steps}
    quality = {}
    if "asr_decode" in steps:
        asr = json.loads((out / "asr" / "decode" / "final" / "test-greedy.json").read_text())
        quality.update(asr_cer=asr["cer"], asr_wer=asr["wer"])
    for step, suffix in (("tts_score_gl", "_gl"), ("tts_score", ""), ("builtin_score_gl", "_builtin_gl"),
                         ("builtin_score", "_builtin")):
        if step not in steps:
            continue
        tts = json.loads(Path(steps[step]["scores"]).read_text())
        judge, recordings = tts["asr"]["cer"], tts["asr_recordings"]["cer"]
        quality.update({f"judge_cer{suffix}": judge, f"recordings_cer{suffix}": recordings,
                        f"mcd{suffix}": tts["mcd"], f"mcd_vocoded{suffix}": tts.get("mcd_vocoded"),
                        f"pesq_vocoder_floor{suffix}": tts.get("pesq_vocoder_floor"),
                        f"length_ratio{suffix}": tts["length_ratio"],
                        f"judge_ratio{suffix}": judge / recordings if recordings else None})
    threads = next((s["torch_threads"] for s in steps.values() if "torch_threads" in s), None)
    result = {"voice": str(args.voice), "lang": args.lang, "smoke": args.smoke, "cache": cache_note,
              "fresh_machine": not args.keep_cache, "steps": steps, "quality": quality,
              "machine": {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
                          "torch_threads": threads, "date": datetime.datetime.now().isoformat(timespec="seconds")}}
    (out / "new_voice.json").write_text(json.dumps(result, indent=1) + "\n")

    minutes = lambda step, key: f"{steps[step][key] / 60:.1f}" if key in steps.get(step, {}) else "–"  # noqa: E731
    pct = lambda key: f"{100 * quality[key]:.1f} %" if quality.get(key) is not None else "–"  # noqa: E731
    num = lambda key, f: format(quality[key], f) if quality.get(key) is not None else "–"  # noqa: E731
    split = lambda step: (f"{minutes(step, 'seconds')}: {minutes(step, 'corpus_seconds')} / "  # noqa: E731
                          f"{minutes(step, 'base_seconds')} / {minutes(step, 'voice_seconds')}")
    print(f"\nwrote {out / 'new_voice.json'}; cache: {cache_note}"
          + ("; --smoke: a pipeline check, not a measurement" if args.smoke else ""))
    print("| voice | ASR train min: corpus / base / voice | test CER (WER) | TTS train min: corpus / base / voice | "
          "vocoder train min: corpus / base / voice | judge ratio: vocoder / Griffin-Lim | MCD (vocoded) dB: "
          "vocoder / Griffin-Lim | PESQ (recordings' mel): vocoder / Griffin-Lim |\n|---|---|---|---|---|---|---|---|")
    print(f"| {args.voice.name} ({args.lang}) | {split('asr_train')} | {pct('asr_cer')} ({pct('asr_wer')}) | "
          f"{split('tts_train')} | {split('vocoder_train')} | {num('judge_ratio', '.2f')} / {num('judge_ratio_gl', '.2f')} | "
          f"{num('mcd_vocoded', '.2f')} / {num('mcd_vocoded_gl', '.2f')} | "
          f"{num('pesq_vocoder_floor', '.2f')} / {num('pesq_vocoder_floor_gl', '.2f')} |")
    if "builtin_score" in steps:
        print(f"| built-in voice (the bases; judge: the ASR base) | | | | | {num('judge_ratio_builtin', '.2f')} / "
              f"{num('judge_ratio_builtin_gl', '.2f')} | {num('mcd_vocoded_builtin', '.2f')} / "
              f"{num('mcd_vocoded_builtin_gl', '.2f')} | {num('pesq_vocoder_floor_builtin', '.2f')} / "
              f"{num('pesq_vocoder_floor_builtin_gl', '.2f')} |")

if __name__ == "__main__":
    main()
