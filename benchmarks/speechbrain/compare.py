"""Our BEST-RQ vs SpeechBrain 1.1.2's BEST-RQ recipe: training throughput on the same corpus.

    bash benchmarks/speechbrain/setup.sh [--repo PATH --ref REF]     # once: SpeechBrain's venv + recipe
    PYTHONPATH=. python benchmarks/speechbrain/compare.py             # ours, theirs, ours, theirs, ...

Both sides train the same Conformer size (hidden 144, 4 layers, 4 heads, FFN 576, conv kernel 15,
codebook 8192) on batches of at most 60 padded seconds of audio, fp32, gradient accumulation 1,
gradient-norm clip 5.0, for `--max_steps` optimizer steps, on our built-in corpus (written as
SpeechBrain's CSV files by bridge.py). SpeechBrain's `train.py` does `hparams.update(run_opts)`,
which resets `precision`, `grad_accumulation_factor`, `max_grad_norm` (and `optimizer_step_limit`)
to the run-option defaults whatever the YAML says: we therefore pass them as run options, so what
runs is what we asked for. (Their run is ended by this script after the last timed step: see
run_side for why --optimizer_step_limit cannot do it in 1.1.2.)

Two modes, interleaved per repetition (ours, theirs in each):
  normal: each side as normally run: ours `accelerate launch recipes/best_rq/train.py` (the recipe
          picks the torch threads: one per core), theirs `python train.py hparams.yaml` (torch's default threads,
          the recipe's 4 data-loading worker processes);
  equal:  both with `--threads` torch threads (OMP_NUM_THREADS, MKL_NUM_THREADS; ours also
          `--num_threads`) and no data-loading worker processes (ours has none by default; theirs is set to 0).

Throughput is steady state: seconds of unpadded audio in optimizer steps (warmup_steps, max_steps]
divided by the time between the end of step `warmup_steps` and the end of step `max_steps`, from a
per-step timestamp that steplog/sitecustomize.py writes on both sides (start-up, data preparation,
our feature statistics, their end-of-training validation are outside the window).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SB_PYTHON = HERE / ".venv" / "bin" / "python"
SB_RECIPE = HERE / ".sb_repo" / "recipes" / "LibriSpeech" / "self-supervised-learning" / "BEST-RQ"
SAMPLE_RATE = 16000  # Hz, the built-in corpus and both recipes

# The shared model and batch: our recipe's Config names → SpeechBrain's YAML keys.
SIZE = dict(hidden_size=144, num_layers=4, num_heads=4, ffn_dim=576, conv_kernel=15, codebook_size=8192)
BATCH_SECONDS = 60.0  # padded seconds of audio per batch (ours: max_batch_seconds, theirs: max_batch_len)
MAX_GRAD_NORM = 5.0  # ours: Config default; theirs: the run-option default their hparams.update() imposes
NUM_BUCKETS = 10  # duration buckets for batching (ours: default; theirs: 200 in the YAML)


def refuse(msg: str) -> None:
    sys.exit(f"compare.py: {msg}")


def speechbrain_yaml(out: Path) -> Path:
    """Their hparams YAML with one line added: the Conformer's convolution kernel (TransformerASR
    takes `kernel_size`, default 31, and the YAML does not name it, so no override can reach it)."""
    text = (SB_RECIPE / "hparams" / "BEST-RQ.yaml").read_text()
    anchor = "    encoder_module: conformer\n"
    if text.count(anchor) != 1:
        refuse(f"BEST-RQ.yaml has no single '{anchor.strip()}' line to add kernel_size after; "
               "this script knows SpeechBrain 1.1's YAML, re-run setup.sh with a 1.1 --ref")
    path = out / "speechbrain_BEST-RQ.yaml"
    path.write_text(text.replace(anchor, anchor + f"    kernel_size: {SIZE['conv_kernel']}  # added by compare.py\n"))
    return path


def our_command(run: Path, max_steps: int) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "recipes/best_rq/train.py",
            "--output_dir", str(run), "--max_steps", str(max_steps), "--mixed_precision", "no",
            "--max_batch_seconds", str(BATCH_SECONDS), "--num_buckets", str(NUM_BUCKETS),
            "--max_grad_norm", str(MAX_GRAD_NORM), "--gradient_accumulation_steps", "1",
            *[a for k, v in SIZE.items() for a in (f"--{k}", str(v))],
            "--eval_steps", "0", "--save_steps", str(max_steps), "--report_to", "none",
            "--dump_batch_ids", "true"]  # ids per batch → the audio seconds of each step


def their_command(run: Path, yaml: Path, data: Path, csvs: dict, workers: int | None,
                  max_batch_len: float) -> list[str]:
    cmd = [str(SB_PYTHON), "train.py", str(yaml), "--data_folder", str(data), "--output_folder", str(run),
           "--train_csv", str(csvs["train"]), "--valid_csv", str(csvs["validation"]), "--skip_prep", "True",
           "--d_model", str(SIZE["hidden_size"]), "--num_encoder_layers", str(SIZE["num_layers"]),
           "--nhead", str(SIZE["num_heads"]), "--d_ffn", str(SIZE["ffn_dim"]), "--cb_vocab", str(SIZE["codebook_size"]),
           "--max_batch_len", str(max_batch_len), "--train_num_buckets", str(NUM_BUCKETS),
           # our corpus has utterances under their 2 s floor: keep every one, like our data check (0.5–30 s)
           "--avoid_if_shorter_than", "0.5", "--avoid_if_longer_than", "30.0",
           "--streaming", "False",  # full attention, like ours (no dynamic chunk masks)
           # run options: what their hparams.update(run_opts) would otherwise reset silently
           "--precision", "fp32", "--grad_accumulation_factor", "1", "--max_grad_norm", str(MAX_GRAD_NORM),
           # the validation pass after the last step is outside the window: no worker processes for it
           "--test_dataloader_options", "{batch_size: 8, num_workers: 0}"]
    if workers is not None:
        cmd += ["--train_dataloader_options", f"{{num_workers: {workers}}}"]
    return cmd


def run_side(side: str, cmd: list[str], cwd: Path, run: Path, env: dict, max_steps: int) -> list[dict]:
    """Run one side to `max_steps` optimizer steps; returns its step-log lines."""
    run.mkdir(parents=True)
    steps = run.parent / f"{run.name}.steps.jsonl"  # beside the run: our recipe refuses foreign files in its output_dir
    env = {**env, "BENCH_STEP_LOG": str(steps),
           "PYTHONPATH": os.pathsep.join([str(HERE / "steplog"), str(ROOT)])}
    if side == "theirs":
        env["BENCH_SB_AUDIO"] = str(SAMPLE_RATE)
    log_path = run.parent / f"{run.name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stopped = False
        while proc.poll() is None:
            time.sleep(1.0)
            # Theirs cannot be told to stop: SpeechBrain 1.1.2 types run options from their defaults,
            # so --optimizer_step_limit (default None) arrives as a str and its first comparison with
            # an int raises TypeError; the YAML's optimizer_step_limit is reset to None by the recipe's
            # hparams.update(run_opts). So we end it (process group: its data-loading workers too)
            # once step `max_steps` is logged; nothing after that step is measured.
            if side == "theirs" and _count_steps(run.parent, steps.name) >= max_steps:
                os.killpg(proc.pid, signal.SIGTERM)
                stopped = True
                proc.wait()
    if proc.returncode != 0 and not stopped:
        refuse(f"{side} exited with {proc.returncode}; its output is in {log_path}")
    logs = list(run.parent.glob(f"{steps.name}.*"))
    if len(logs) != 1:
        refuse(f"{side}: expected one training process writing step times, found {len(logs)} ({log_path})")
    return [json.loads(line) for line in logs[0].read_text().splitlines()]


def _count_steps(folder: Path, name: str) -> int:
    return sum(p.read_text().count('"step_end"') for p in folder.glob(f"{name}.*"))


def throughput(side: str, lines: list[dict], run: Path, durations: dict, warmup: int, max_steps: int) -> dict:
    ends = [x["step_end"] for x in lines if "step_end" in x]
    threads = next(x["torch_threads"] for x in lines if "torch_threads" in x)
    if side == "theirs":  # fit_batch writes the batch's audio just before its step
        audio = [x["audio_s"] for x in lines if "audio_s" in x]
    else:  # one line per batch (accumulation 1) with its utterance ids
        audio = [sum(durations[i] for i in json.loads(line)["ids"])
                 for line in (run / "batch_ids.rank0.jsonl").read_text().splitlines()]
    if len(ends) < max_steps or len(audio) < max_steps:
        refuse(f"{side}: {len(ends)} optimizer steps, {len(audio)} batches logged in {run}, expected {max_steps}")
    seconds = ends[max_steps - 1] - ends[warmup - 1]
    audio_s = sum(audio[warmup:max_steps])
    return dict(audio_per_s=audio_s / seconds, s_per_step=seconds / (max_steps - warmup),
                audio_per_step=audio_s / (max_steps - warmup), torch_threads=threads)


def parameter_counts(yaml: Path) -> dict:
    """Encoder parameters of both sides, split into front end / Conformer / prediction head."""
    ours = subprocess.run([sys.executable, "-c", f"""
import json, types, torch
from common.model.encoder import StackedLogMelEncoder, encoder_config_from
cfg = types.SimpleNamespace(n_mels=80, stack_frames=4, dropout=0.1, sample_rate={SAMPLE_RATE}, **{SIZE!r})
enc = StackedLogMelEncoder(encoder_config_from(cfg), n_mels=80, stack_frames=4).encoder
n = lambda m: sum(p.numel() for p in m.parameters())
print(json.dumps(dict(front_end=n(enc.feature_projection), conformer=n(enc) - n(enc.feature_projection),
                      head=(cfg.hidden_size + 1) * cfg.codebook_size)))
"""], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    theirs = subprocess.run([str(SB_PYTHON), "-c", f"""
import json
from hyperpyyaml import load_hyperpyyaml
overrides = dict(data_folder="unused", d_model={SIZE['hidden_size']}, num_encoder_layers={SIZE['num_layers']},
                 nhead={SIZE['num_heads']}, d_ffn={SIZE['ffn_dim']}, cb_vocab={SIZE['codebook_size']})
hp = load_hyperpyyaml(open({str(yaml)!r}), overrides)
n = lambda m: sum(p.numel() for p in m.parameters())
t = hp["Transformer"]
print(json.dumps(dict(front_end=n(hp["CNN"]) + n(t.custom_src_module), conformer=n(t.encoder),
                      head=n(hp["linear"]), unused_decoder_side=n(t) - n(t.encoder) - n(t.custom_src_module))))
"""], cwd=HERE, capture_output=True, text=True)
    for name, proc in (("ours", ours), ("theirs", theirs)):
        if proc.returncode != 0:
            refuse(f"counting {name}'s parameters failed: {proc.stderr.strip().splitlines()[-1]}")
    return dict(ours=json.loads(ours.stdout.splitlines()[-1]), theirs=json.loads(theirs.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3, help="runs of each side per mode")
    parser.add_argument("--warmup_steps", type=int, default=5, help="optimizer steps before the timed window")
    parser.add_argument("--max_steps", type=int, default=25, help="optimizer steps per run (window: warmup_steps..max_steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides in the 'equal' mode")
    parser.add_argument("--modes", default="normal,equal", help="comma-separated: normal, equal")
    parser.add_argument("--their_max_batch_len", type=float, default=BATCH_SECONDS,
                        help="SpeechBrain's max_batch_len in seconds; its sampler fills batches less than ours "
                             "at the same value, so a larger one checks how much batch size explains")
    parser.add_argument("--data_dir", default=None, help="LibriSpeech-layout root; default: the built-in corpus")
    parser.add_argument("--out", default=str(HERE / "runs"), help="where runs and results.json go")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"normal", "equal"}:
        refuse(f"--modes {args.modes}: choose from normal, equal")
    if not 0 < args.warmup_steps < args.max_steps:
        refuse("--warmup_steps must be ≥ 1 and below --max_steps (the window is warmup_steps..max_steps)")
    if not SB_PYTHON.is_file() or not (SB_RECIPE / "train.py").is_file():
        refuse("SpeechBrain's environment or recipe is missing; run: bash benchmarks/speechbrain/setup.sh")

    from tools.corpus import resolve_data_dir  # our toolbox: after --help and the checks above
    sys.path.insert(0, str(HERE))
    from bridge import write_speechbrain_csv

    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    data = Path(resolve_data_dir(args.data_dir, None, "default", "librispeech"))
    csvs = {split: out / "data" / f"{split}.csv" for split in ("train", "validation")}
    durations = {}
    for split, path in csvs.items():
        durations.update(write_speechbrain_csv(data, split, path))
    yaml = speechbrain_yaml(out)
    params = parameter_counts(yaml)
    print(f"data: {data}  ({len(durations)} utterances in train+validation)")
    for side in ("ours", "theirs"):
        print(f"{side:6s} parameters: " + ", ".join(f"{k} {v / 1e6:.3f} M" for k, v in params[side].items()))

    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    equal_env = {**base_env, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    results = {mode: {"ours": [], "theirs": []} for mode in modes}
    for rep in range(args.repetitions):
        for mode in modes:
            for side in ("ours", "theirs"):  # interleaved: ours, theirs, ours, theirs, ...
                run = out / f"{mode}-{side}-{rep}"
                if side == "ours":
                    cmd, cwd = our_command(run, args.max_steps), ROOT
                    if mode == "equal":  # OMP_NUM_THREADS=1 alone reads as accelerate's default: say it
                        cmd += ["--num_threads", str(args.threads)]
                else:
                    cmd = their_command(run, yaml, data, csvs, 0 if mode == "equal" else None, args.their_max_batch_len)
                    cwd = SB_RECIPE
                lines = run_side(side, cmd, cwd, run, equal_env if mode == "equal" else base_env, args.max_steps)
                r = throughput(side, lines, run, durations, args.warmup_steps, args.max_steps)
                results[mode][side].append(r)
                print(f"rep {rep} {mode:6s} {side:6s}: {r['audio_per_s']:7.2f} audio-s/s, {r['s_per_step']:.2f} s/step, "
                      f"{r['audio_per_step']:.1f} audio-s/step, {r['torch_threads']} torch threads", flush=True)

    summary = {"repetitions": args.repetitions, "their_max_batch_len": args.their_max_batch_len,
               "window_steps": [args.warmup_steps, args.max_steps],
               "parameters": params, "runs": results}
    print(f"\n{args.repetitions} repetitions per side and mode; steady state: optimizer steps "
          f"{args.warmup_steps}..{args.max_steps}; medians:")
    for mode in modes:
        med = {side: statistics.median(r["audio_per_s"] for r in results[mode][side]) for side in ("ours", "theirs")}
        threads = {side: sorted({r["torch_threads"] for r in results[mode][side]}) for side in ("ours", "theirs")}
        summary[mode] = {**med, "ratio": med["ours"] / med["theirs"], "torch_threads": threads}
        print(f"  {mode:6s}: ours {med['ours']:.2f}, theirs {med['theirs']:.2f} audio-s/s → ours/theirs "
              f"{med['ours'] / med['theirs']:.2f}  (torch threads: ours {threads['ours']}, theirs {threads['theirs']})")
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"runs and results.json: {out}")


if __name__ == "__main__":
    main()
