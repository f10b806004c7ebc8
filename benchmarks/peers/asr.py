"""ASR from scratch at equal wall-clock budgets: our recipe against SpeechBrain's and transformers',
same data, same test split, same scoring code. A results script (CI never runs it).

    bash benchmarks/speechbrain/setup.sh [--repo PATH --ref REF]           # once: SpeechBrain 1.1.2 + its recipes
    python benchmarks/peers/asr.py train --system ours --out runs/peers/ours
    python benchmarks/peers/asr.py train --system speechbrain --variant cpu --out runs/peers/sb-cpu
    python benchmarks/peers/asr.py train --system transformers --hf_script <transformers checkout>/examples/pytorch/speech-recognition/run_speech_recognition_ctc.py --out runs/peers/hf
    python benchmarks/peers/asr.py report runs/peers/*/ --plot runs/peers/cer.png

`train` starts the system's own training command at time T0 and keeps, for each budget point
(--points, minutes of wall time since T0: start-up, data preparation, validation passes all count),
the model as it was at that time; at the last point the run is ended. Each kept model then decodes
the test split greedily with its own system's code, and every hypothesis file is scored here by the
same code (recipes/asr/metrics: corpus-level CER and WER). Writes <out>/result.json.

- ours: `accelerate launch recipes/asr/train.py`, default config (plus --data_dir when given), from
  scratch (`--init_from none`: the peers start from nothing either; `--ours_args "--init_from builtin"`
  times the default start from the built-in base instead), `--save_steps 100 --save_total_limit 0`; the model at point p is the last checkpoint complete
  before p (one every 100 steps, 15-35 s here: ours is measured up to one interval early), decoded by
  recipes/asr/decode.py. At the last point SIGTERM: the recipe saves that step and exits.
- speechbrain: their recipes/LibriSpeech/ASR/CTC/train.py with hparams/conformer_large.yaml (a
  Conformer-CTC, 18 layers, d_model 256, characters) on our corpus through bridge.py's CSV files; the
  model at point p is saved by peers/sb_hook/sitecustomize.py after the first batch that ends past p,
  decoded by peers/sb_decode.py (their VALID-stage greedy decoding).
  `--variant shipped`: the YAML as published, tuned for 8 GPUs: 850-s batches and a 7500-step warm-up,
  i.e. a few optimizer steps in 30 CPU minutes, at a learning rate still ~1e-6.
  `--variant cpu` (default): the same recipe and model with the two settings a user of one CPU
  changes first: batches of our size (max_batch_length_train 20 s) and our warm-up (150 steps).
  `--variant small`: `cpu` with our encoder's size (d_model 144, 4 layers, 4 heads, FFN 576; their
  convolutional front end and kernel 31 kept): separates their recipe from their model's size.
- transformers: their examples/pytorch/speech-recognition/run_speech_recognition_ctc.py (`--hf_script`,
  from a transformers checkout: the script is not in the wheel), with the few patches hf_ctc.py lists
  for transformers 5 / datasets 5, on a parquet copy of the corpus (hf_ctc.py export); the model a
  Wav2Vec2ForCTC of our encoder's size from its own initialization (hf_ctc.MODEL: no pretrained
  weights offline). Their README's example values (learning rate 3e-4, linear decay, AdamW, time
  masking 0.05) with the two settings a CPU user changes first, as for speechbrain: batches of our
  size (per-device batch = our 20 s over the mean utterance) and our warm-up (150 steps); the linear
  decay ends at --hf_max_steps (the steps it makes in the budget here). The feature encoder trains
  (the script freezes it by default, for a pretrained one). `--variant lr1e-3`: our learning rate;
  `--variant conv128`: that, with the waveform convolutions at 128 channels (1.46 M parameters, a
  cheaper step: more steps in the budget).
  The model at point p is the last checkpoint (every 25 steps) complete before it, decoded greedily
  by hf_ctc.py decode (the processor's batch_decode of the argmax, as the script's metric does; one
  utterance at a time).
`--threads normal`: each as normally run (ours: the recipe's own choice, one thread per core; theirs:
torch's default threads and the YAML's 8 data-loading workers); `--threads N`: N torch threads
(OMP/MKL_NUM_THREADS, ours --num_threads N) and no data-loading workers for theirs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SB = ROOT / "benchmarks" / "speechbrain"
SB_PYTHON = SB / ".venv" / "bin" / "python"
SB_RECIPE = SB / ".sb_repo" / "recipes" / "LibriSpeech" / "ASR" / "CTC"
OUR_BATCH_SECONDS, OUR_WARMUP = 20.0, 150  # recipes/asr/config.yaml: max_batch_seconds, warmup_steps
HF_SAVE_STEPS = 25  # ~50 s apart at one thread (256 channels; ~19 s at 128): how early a kept model can be


def refuse(msg: str) -> None:
    sys.exit(f"asr.py: {msg}")


def launch(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[subprocess.Popen, float]:
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "PEER_T0": repr(t0)}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, t0


class CpuMeter:
    """CPU seconds of a training's process tree (the launcher, the training process, its data-loading
    workers), sampled every second: the last reading of each process counts (a process that ends
    between two readings loses under a second). Needed because a process whose launcher returned
    first is never reaped by us, so `RUSAGE_CHILDREN` would miss it."""

    def __init__(self, pid: int):
        import psutil

        self.root, self.seen = psutil.Process(pid), {}

    def sample(self) -> None:
        import psutil

        try:
            for p in [self.root, *self.root.children(recursive=True)]:
                t = p.cpu_times()
                self.seen[p.pid] = t.user + t.system
        except psutil.Error:
            pass

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


def wait_metered(proc: subprocess.Popen, deadline: float, meter: CpuMeter, until_group_ends: bool = False) -> None:
    while (proc.poll() is None or until_group_ends and group_alive(proc.pid)) and time.time() < deadline:
        meter.sample()
        time.sleep(1.0)


def end_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # data-loading workers left by a process that ended itself
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def with_flags(cmd: list[str], extra: str) -> list[str]:
    """`cmd` (a train.py command of `--key value` flags) with the flags of `extra` (--ours_args, an
    ablation) in place of its own: train.py refuses a flag given twice."""
    extra_args = shlex.split(extra)
    given = {a.split("=")[0].replace("-", "_") for a in extra_args if a.startswith("--")}
    kept, i = [], 0
    while i < len(cmd):
        drop = cmd[i].startswith("--") and cmd[i].split("=")[0].replace("-", "_") in given
        span = 2 if drop and "=" not in cmd[i] and i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else 1
        kept += [] if drop else cmd[i : i + span]
        i += span
    return kept + extra_args


def thread_env(threads: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH")}
    if threads != "normal":
        env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return env


# ---- ours -------------------------------------------------------------------------------------------

def train_ours(args, data: Path | None, out: Path, points: list[float]) -> tuple[list[dict], float]:
    run = out / "train"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "recipes/asr/train.py", "--output_dir", str(run),
           "--max_steps", "1000000", "--save_steps", "100", "--save_total_limit", "0", "--report_to", "none",
           "--init_from", "none"]
    cmd += ["--data_dir", str(data)] if data else []
    cmd += [] if args.threads == "normal" else ["--num_threads", args.threads]
    cmd += [] if args.seed is None else ["--seed", str(args.seed)]
    cmd = with_flags(cmd, args.ours_args)  # an ablation: flags of recipes/asr/train.py, in place of those above
    env = thread_env(args.threads) | {"PYTHONPATH": str(ROOT)}
    proc, t0 = launch(cmd, ROOT, env, out / "train.log")
    deadline, meter = t0 + 60 * points[-1], CpuMeter(proc.pid)
    wait_metered(proc, deadline, meter)
    if proc.poll() is not None:
        refuse(f"ours ended before the budget (exit {proc.returncode}); see {out / 'train.log'}")
    # The preemption path, to the training process itself (the launcher may return before it has
    # saved): it saves the step it is in and exits 75.
    os.killpg(proc.pid, signal.SIGTERM)
    wait_metered(proc, deadline + 300, meter, until_group_ends=True)
    end_session(proc)
    ckpts = sorted((run / "checkpoints").glob("step_*/COMPLETE"))
    done = [(c.parent, (c.stat().st_mtime - t0) / 60) for c in ckpts]
    kept = []
    for p in points:
        before = [(d, m) for d, m in done if m <= p] if p != points[-1] else done[-1:]
        if not before:
            refuse(f"ours: no checkpoint complete within {p} min")
        folder, minutes = before[-1]
        kept.append({"point": p, "minutes": round(minutes, 3), "optimizer_steps": int(folder.name[5:]),
                     "model": str(folder)})
    for k in kept:
        dec = subprocess.run([sys.executable, "recipes/asr/decode.py", "--checkpoint", k["model"], "--split", "test",
                              "--output", str(out / "decode" / f"min{k['point']:g}")],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if dec.returncode != 0:
            refuse(f"decoding {k['model']} failed: {dec.stderr.strip()[-500:]}")
        k["hyps"] = str(out / "decode" / f"min{k['point']:g}" / "test-greedy.jsonl")
    return kept, meter.seconds


# ---- SpeechBrain ------------------------------------------------------------------------------------

# transformers' steps in 30 minutes of one thread here (2-core VM): where its linear decay should end
HF_STEPS_30MIN = {"cpu": 925, "lr1e-3": 925, "conv128": 2400}


def hf_max_steps(args, points: list[float]) -> int:
    """--hf_max_steps, or the steps the variant makes by the last budget point (HF_STEPS_30MIN, scaled)."""
    return args.hf_max_steps or round(HF_STEPS_30MIN[args.variant] * points[-1] / 30)


def speechbrain_yaml(variant: str, out: Path) -> Path:
    text = (SB_RECIPE / "hparams" / "conformer_large.yaml").read_text()
    if variant in ("cpu", "small"):
        for old, new in (("max_batch_length_train: 850\n", f"max_batch_length_train: {OUR_BATCH_SECONDS:g}  # peers/asr.py: was 850\n"),
                         ("    n_warmup_steps: 7500\n", f"    n_warmup_steps: {OUR_WARMUP}  # peers/asr.py: was 7500\n")):
            if text.count(old) != 1:
                refuse(f"conformer_large.yaml has no single '{old.strip()}' line; this script knows SpeechBrain "
                       "1.1's YAML: re-run benchmarks/speechbrain/setup.sh with a 1.1 --ref")
            text = text.replace(old, new)
    path = out / f"conformer_large-{variant}.yaml"
    path.write_text(text)
    return path


def normalize_csv(path: Path) -> None:
    """Transcripts as our recipe trains on and scores them (recipes/asr/text.py: lowercase, punctuation
    to spaces, digits kept): both systems learn, and are scored on, the same text."""
    sys.path.insert(0, str(ROOT / "recipes" / "asr"))
    from text import normalize_text

    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "wrd": normalize_text(r["wrd"])} for r in rows)


def train_speechbrain(args, data: Path, out: Path, points: list[float]) -> tuple[list[dict], float]:
    sys.path.insert(0, str(SB))
    from bridge import write_speechbrain_csv

    csvs = {s: out / "data" / f"{s}.csv" for s in ("train", "validation", "test")}
    for split, path in csvs.items():
        write_speechbrain_csv(data, split, path)
        normalize_csv(path)
    yaml = speechbrain_yaml(args.variant, out)
    # Their YAML fixes 31 outputs (English letters, apostrophe, word boundary + 3 specials): another
    # language needs its own count, as their SentencePiece character model makes it.
    with open(csvs["train"], newline="", encoding="utf-8") as f:
        alphabet = {c for row in csv.DictReader(f) for c in row["wrd"]} | {" "}
    overrides = ["--output_neurons", str(len(alphabet) + 3), "--data_folder", str(data), "--output_folder", str(out / "sb"), "--skip_prep", "True",
                 "--train_csv", str(csvs["train"]), "--valid_csv", str(csvs["validation"]),
                 "--test_csv", f"[{csvs['test']}]"]
    run_opts = ["--precision", "fp32", "--grad_accumulation_factor", "1"]  # what hparams.update(run_opts) imposes anyway
    if args.variant == "small":  # our encoder's size (recipes/asr/config.yaml); their front end and kernel
        overrides += ["--d_model", "144", "--num_encoder_layers", "4", "--nhead", "4", "--d_ffn", "576"]
    if args.threads != "normal":
        overrides += ["--num_workers", "0"]
    if args.seed is not None:  # their YAML's `seed` (3402) seeds the run's every random draw
        overrides += ["--seed", str(args.seed)]
    snapshots = out / "snapshots"
    snapshots.mkdir()
    env = thread_env(args.threads) | {"PYTHONPATH": str(HERE / "sb_hook"), "PEER_SNAPSHOTS": str(snapshots),
                                      "PEER_POINTS": ",".join(f"{p:g}" for p in points)}
    proc, t0 = launch([str(SB_PYTHON), "train.py", str(yaml), *overrides, *run_opts], SB_RECIPE, env, out / "train.log")
    deadline, meter = t0 + 60 * points[-1] + 600, CpuMeter(proc.pid)  # the last batch may take a while
    wait_metered(proc, deadline, meter)
    end_session(proc)
    if proc.returncode != 0:
        refuse(f"speechbrain ended with exit {proc.returncode} before the last point; see {out / 'train.log'}")
    kept = [json.loads(line) for line in (snapshots / "snapshots.jsonl").read_text().splitlines()]
    for k in kept:
        k["model"] = str(snapshots / f"CKPT+min{k['point']:g}")
        k["hyps"] = str(out / "decode" / f"min{k['point']:g}.jsonl")
        Path(k["hyps"]).parent.mkdir(exist_ok=True)
        dec = subprocess.run([str(SB_PYTHON), str(HERE / "sb_decode.py"), str(yaml), k["model"], k["hyps"], *overrides],
                             cwd=SB_RECIPE, env=thread_env(args.threads), capture_output=True, text=True)
        if dec.returncode != 0:
            refuse(f"decoding {k['model']} failed: {dec.stderr.strip()[-800:]}")
    return kept, meter.seconds


# ---- transformers ------------------------------------------------------------------------------------

def train_transformers(args, data: Path, out: Path, points: list[float]) -> tuple[list[dict], float]:
    import hf_ctc
    from common.data.manifest import read_librispeech

    script = Path(args.hf_script or "")
    if not script.is_file():
        refuse("--hf_script: give transformers' examples/pytorch/speech-recognition/run_speech_recognition_ctc.py "
               "from a checkout of github.com/huggingface/transformers (it is not in the pip package)")
    try:
        import torchcodec  # noqa: F401  (datasets 5 decodes the script's Audio column through it)
    except ImportError:
        refuse("transformers' script needs TorchCodec and FFmpeg to decode audio: pip install torchcodec==0.17.0; "
               "apt-get install ffmpeg")
    hf_ctc.patch_script(script, out / "run_speech_recognition_ctc.py")
    hf_ctc.export(data, out / "dataset")
    seed = 42 if args.seed is None else args.seed
    hf_ctc.init_model(out / "init", seed, conv_channels=128 if args.variant == "conv128" else 256)
    train = read_librispeech(data, "train")
    batch = max(1, round(OUR_BATCH_SECONDS / (sum(r["duration"] for r in train) / len(train))))
    lr = {"cpu": "3e-4", "lr1e-3": "1e-3", "conv128": "1e-3"}[args.variant]
    # The script builds its vocabulary from the train and eval splits and needs both to exist (with
    # one split its reduce() returns a dataset, not a set); evaluation itself would run only after
    # training ends (eval_strategy "no"), past the budget. Its metric loads from our local module
    # (evaluate.load("wer") needs the hub).
    evaluation = "validation" if (data / "validation").is_dir() else "test"
    cmd = [sys.executable, str(out / "run_speech_recognition_ctc.py"), "--model_name_or_path", str(out / "init"),
           "--dataset_name", str(out / "dataset"), "--train_split_name", "train", "--eval_split_name", evaluation,
           "--do_train", "--do_eval", "--eval_metrics", str(ROOT / "recipes" / "asr" / "metrics" / "cer"),
           "--output_dir", str(out / "hf"), "--use_cpu", "--report_to", "none", "--seed", str(seed),
           "--freeze_feature_encoder", "False", "--per_device_train_batch_size", str(batch),
           "--learning_rate", lr, "--warmup_steps", str(OUR_WARMUP), "--max_steps", str(hf_max_steps(args, points)),
           "--train_sampling_strategy", "group_by_length", "--length_column_name", "input_length",
           "--save_steps", str(HF_SAVE_STEPS), "--save_only_model", "--logging_steps", "25"]
    proc, t0 = launch(cmd, ROOT, thread_env(args.threads), out / "train.log")
    deadline, meter = t0 + 60 * points[-1], CpuMeter(proc.pid)
    wait_metered(proc, deadline, meter)
    end_session(proc)  # at the budget (or after the script's own end: its last checkpoint stands)
    done = []
    for c in (out / "hf").glob("checkpoint-*"):
        files = [c / "model.safetensors", c / "trainer_state.json"]
        if all(f.is_file() for f in files):  # a checkpoint cut by the end of the budget is not kept
            done.append((c, (max(f.stat().st_mtime for f in c.iterdir()) - t0) / 60))
    done.sort(key=lambda d: d[1])
    kept = []
    for p in points:
        before = [(d, m) for d, m in done if m <= p]
        if not before:
            refuse(f"transformers: no checkpoint complete within {p} min; see {out / 'train.log'}")
        folder, minutes = before[-1]
        k = {"point": p, "minutes": round(minutes, 3), "optimizer_steps": int(folder.name.split("-")[1]),
             "model": str(folder), "hyps": str(out / "decode" / f"min{p:g}.jsonl")}
        dec = subprocess.run([sys.executable, str(HERE / "hf_ctc.py"), "decode", "--checkpoint", k["model"],
                              "--processor", str(out / "hf"), "--dataset", str(out / "dataset"), "--out", k["hyps"]],
                             cwd=ROOT, env=thread_env(args.threads) | {"PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True)
        if dec.returncode != 0:
            refuse(f"decoding {k['model']} failed: {dec.stderr.strip()[-800:]}")
        kept.append(k)
    return kept, meter.seconds


# ---- scoring and report -----------------------------------------------------------------------------

def score(hyps: Path) -> dict:
    sys.path.insert(0, str(ROOT / "recipes" / "asr"))
    from scoring import Scorer

    from text import normalize_text

    rows = [json.loads(line) for line in hyps.read_text().splitlines()]
    # One definition for every system (ours writes normalized text already: unchanged by this).
    return {"utterances": len(rows), **Scorer()([normalize_text(r["hyp"]) for r in rows],
                                                [normalize_text(r["ref"]) for r in rows])}


def git_commit(path: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def train(args) -> None:
    points = sorted(float(p) for p in args.points.split(","))
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        refuse(f"{out} is not empty; give a new --out")
    variants = {"speechbrain": ("cpu", "small", "shipped"), "transformers": ("cpu", "lr1e-3", "conv128")}
    if args.system in variants and args.variant not in variants[args.system]:
        refuse(f"--variant {args.variant} is not one of {args.system}'s: {', '.join(variants[args.system])}")
    if args.threads != "normal" and not args.threads.isdigit():
        refuse(f"--threads {args.threads}: 'normal' or a number")
    if args.system == "speechbrain" and not (SB_PYTHON.is_file() and (SB_RECIPE / "train.py").is_file()):
        refuse("SpeechBrain's environment or CTC recipe is missing; run: bash benchmarks/speechbrain/setup.sh")
    sys.path.insert(0, str(ROOT))
    from tools.corpus import resolve_data_dir

    out.mkdir(parents=True, exist_ok=True)
    data = Path(resolve_data_dir(args.data_dir, None, "default", "librispeech")).resolve()
    if args.system == "ours":
        kept, train_cpu_s = train_ours(args, Path(args.data_dir).resolve() if args.data_dir else None, out, points)
        version = f"this repository @ {git_commit(ROOT)}"
    elif args.system == "transformers":
        import transformers

        kept, train_cpu_s = train_transformers(args, data, out, points)
        import hashlib

        digest = hashlib.sha256(Path(args.hf_script).read_bytes()).hexdigest()[:12]  # which copy of the script ran
        version = (f"transformers {transformers.__version__}, script of transformers@8d3ba495 (sha256 {digest}…, "
                   "patched: hf_ctc.py)")
    else:
        kept, train_cpu_s = train_speechbrain(args, data, out, points)
        version = f"speechbrain 1.1.2, recipe {(SB / '.sb_repo' / 'SOURCE.txt').read_text().splitlines()[1]}"
    for k in kept:
        k |= score(Path(k["hyps"]))
        print(f"{args.system} {k['point']:g} min (model at {k['minutes']:.2f} min, {k['optimizer_steps']} steps): "
              f"CER {100 * k['cer']:.1f} %, WER {100 * k['wer']:.1f} %", flush=True)
    variant = args.variant if args.system != "ours" else args.ours_args or "default"
    result = {"system": args.system, "variant": variant, "seed": args.seed,
              "threads": args.threads, "data": str(data), "version": version, "command": " ".join(sys.argv),
              "train_cpu_s": round(train_cpu_s),  # the training's process tree, decoding not included
              "points": kept}
    (out / "result.json").write_text(json.dumps(result, indent=1))


def label(r: dict) -> str:
    variant = "" if r["variant"] == "default" else f" ({r['variant']})"
    return r["system"] + variant + ("" if r.get("seed") is None else f", seed {r['seed']}")


def load_results(runs: list[str]) -> list[dict]:
    """Each run: a `train --out` folder, or a result file kept in benchmarks/peers/results/."""
    return [json.loads((Path(d) if d.endswith(".json") else Path(d) / "result.json").read_text()) for d in runs]


def report(args) -> None:
    results = load_results(args.runs)
    points = sorted({k["point"] for r in results for k in r["points"]})
    print("| system | threads | " + " | ".join(f"CER / WER @ {p:g} min" for p in points) + " | training CPU-min | version |")
    print("|---|---|" + "---|" * len(points) + "---|---|")
    for r in results:
        at = {k["point"]: k for k in r["points"]}
        cells = [f"{100 * at[p]['cer']:.1f} / {100 * at[p]['wer']:.1f} ({at[p]['optimizer_steps']} steps)"
                 if p in at else "–" for p in points]
        name = label(r)
        cpu = f"{r['train_cpu_s'] / 60:.0f}" if "train_cpu_s" in r else "–"
        print(f"| {name} | {r['threads']} | " + " | ".join(cells) + f" | {cpu} | {r['version']} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        colors = plt.get_cmap("tab20").colors  # one colour per curve: its 10 dark, then its 10 light ones
        style = {"ours": "o-", "speechbrain": "s--", "transformers": "^:"}  # and one line style per system
        for i, r in enumerate(results):
            ax.plot([k["point"] for k in r["points"]], [100 * k["cer"] for k in r["points"]],
                    style.get(r["system"], "o-"), color=colors[(2 * i + i // 10) % 20],
                    label=f"{label(r)}, threads {r['threads']}")
        ax.set(xlabel="wall-clock minutes (2-core VM)", ylabel="test CER % (greedy)", ylim=(0, 100))
        ax.grid(alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")  # beside: never over a curve
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"\nplot: {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one system for the budget, decode and score its kept models")
    t.add_argument("--system", choices=["ours", "speechbrain", "transformers"], required=True)
    t.add_argument("--variant", choices=["cpu", "small", "shipped", "lr1e-3", "conv128"], default="cpu",
                   help="speechbrain's YAML: cpu, small, shipped; transformers' values: cpu, lr1e-3, conv128 (see above)")
    t.add_argument("--hf_script", default=None, help="transformers: path to run_speech_recognition_ctc.py")
    t.add_argument("--hf_max_steps", type=int, default=None,
                   help="transformers: where its linear decay ends; default: the steps one thread made here in the "
                        "budget's last point (~925 in 30 min at 256 channels, ~2400 at 128: --variant conv128)")
    t.add_argument("--threads", default="normal", help="'normal' or a number of torch threads")
    t.add_argument("--ours_args", default="", help="ours: more train.py flags, e.g. '--conv_kernel 31' (an ablation)")
    t.add_argument("--seed", type=int, default=None,
                   help="the run's seed (ours: --seed, default 42; speechbrain: the YAML's seed, 3402): a second run")
    t.add_argument("--points", default="5,10,20,30", help="budget points, minutes since the launch")
    t.add_argument("--data_dir", default=None, help="a LibriSpeech-layout root; default: the built-in corpus")
    t.add_argument("--out", required=True, help="a new folder for this run")
    r = sub.add_parser("report", help="markdown table (and a CER-vs-minutes plot) of finished runs")
    r.add_argument("runs", nargs="+", help="--out folders of `train`, or their result.json files")
    r.add_argument("--plot", default=None, help="PNG to write")
    args = parser.parse_args()
    train(args) if args.command == "train" else report(args)


if __name__ == "__main__":
    main()
