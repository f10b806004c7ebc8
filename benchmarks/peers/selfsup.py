"""Self-supervision at equal wall-clock budgets: SpeechBrain's BEST-RQ pre-training and fine-tuning
recipes on the audio and labels of our SSL protocol (recipes/asr/ssl_protocol.sh). A results script
(CI never runs it); comparison 2 of benchmarks/RESULTS.md.

    bash benchmarks/speechbrain/setup.sh [--repo PATH --ref REF]       # once: SpeechBrain 1.1.2 + its recipes
    python benchmarks/peers/selfsup.py train --threads 1 --out runs/peers/ssl-sb              # pre-train, then fine-tune
    python benchmarks/peers/selfsup.py train --threads 1 --pretrain_minutes 0 --out runs/peers/ssl-sb-scratch
    python benchmarks/peers/selfsup.py report runs/peers/ssl-sb*

Ours is the protocol's own run (`JOBS=2 bash recipes/asr/ssl_protocol.sh --num_threads 1`: BEST-RQ
12 000 steps, 64 min on one thread; fine-tuning 2000 steps on 10 min of labels, 6.5 min). Theirs gets
the same wall time on the same data, from its launch (start-up, data preparation and its own
validation passes count):

1. pre-training: their recipes/LibriSpeech/self-supervised-learning/BEST-RQ (train.py, BEST-RQ.yaml)
   on the `ssl10h` training split (15 120 utterances, 10.7 h; transcripts unused) for
   --pretrain_minutes, the model as it is then kept by peers/sb_hook/sitecustomize.py;
2. fine-tuning: their recipes/LibriSpeech/ASR/CTC/train_with_bestrq.py (train_sb_BEST-RQ.yaml:
   the pre-trained CNN + Conformer, a 3-layer DNN head, characters, CTC) on the protocol's 10-minute
   subset (recipes/asr/subsets/10min.txt), validation on `ssl10h`'s validation split, the model kept
   at each of --finetune_points (minutes since the fine-tuning's launch);
3. each kept model decodes the test split (8 unseen voices, 120 utterances) greedily with their
   recipe's code (peers/sb_decode.py), scored by our code (recipes/asr/metrics), as in asr.py.

Changed in their YAMLs, and why (both recipes are published for 8 GPUs and LibriLight/LibriSpeech):
the encoder at our size (d_model 144, 4 layers, 4 heads, FFN 576, convolution kernel 15: the one
benchmarks/speechbrain/compare.py times; their convolutional front end kept), pre-training batches
of our size (max_batch_len 400 → 60 s, gradient accumulation 2 → 1) and our warm-up (Noam 25 000 →
100 steps: ~2000 steps fit in an hour on one thread, so 25 000 would leave the learning rate at a
tenth of its peak), full attention (`streaming: False`, as ours), fp32, utterances from 0.5 s (their
2 s floor drops part of our corpus), and the CTC output size from the training transcripts. Their
codebook (8192), masking, learning rates and schedules, augmentations and head are theirs.
`--pretrain_minutes 0`: their fine-tuning recipe from a random encoder (the control that says what
their pre-training brought).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from asr import (SB, SB_PYTHON, CpuMeter, end_session, launch, load_results, normalize_csv,  # noqa: E402
                 score, thread_env, wait_metered)

SB_SSL = SB / ".sb_repo" / "recipes" / "LibriSpeech" / "self-supervised-learning" / "BEST-RQ"
SB_CTC = SB / ".sb_repo" / "recipes" / "LibriSpeech" / "ASR" / "CTC"
SIZE = dict(d_model=144, num_encoder_layers=4, nhead=4, d_ffn=576)  # recipes/best_rq/config.yaml
KERNEL = 15  # recipes/best_rq/config.yaml conv_kernel: TransformerASR's kernel_size (its default 31)
OUR_BATCH_SECONDS, OUR_WARMUP = 60.0, 100  # recipes/best_rq/config.yaml: max_batch_seconds, warmup_steps


def refuse(msg: str) -> None:
    sys.exit(f"selfsup.py: {msg}")


def edited_yaml(src: Path, edits: list[tuple[str, str]], out: Path) -> Path:
    text = src.read_text()
    for old, new in edits:
        if text.count(old) != 1:
            refuse(f"{src.name} has no single '{old.strip()}' line; this script knows SpeechBrain 1.1's "
                   "YAMLs: re-run benchmarks/speechbrain/setup.sh with a 1.1 --ref")
        text = text.replace(old, new)
    out.write_text(text)
    return out


def write_csvs(data: Path, out: Path, subset: Path) -> dict[str, Path]:
    sys.path.insert(0, str(SB))
    from bridge import write_speechbrain_csv

    csvs = {s: out / "data" / f"{s}.csv" for s in ("train", "validation", "test")}
    for split, path in csvs.items():
        write_speechbrain_csv(data, split, path)
        normalize_csv(path)
    # the protocol's labelled subset: the committed id list, as recipes/asr/train.py --train_subset reads it
    ids = {line.strip() for line in subset.read_text().splitlines() if line.strip() and not line.startswith("#")}
    with open(csvs["train"], newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["ID"] in ids]
    if len(rows) != len(ids):
        refuse(f"{len(ids) - len(rows)} ids of {subset} are not in {data}/train: not the corpus the subset is of")
    csvs["10min"] = out / "data" / "10min.csv"
    with open(csvs["10min"], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return csvs


def run_until(cmd: list[str], cwd: Path, threads: str, out: Path, points: list[float], name: str) -> tuple[list[dict], float]:
    """Run one of their recipes, keeping the model at each point (minutes since its launch)."""
    snapshots = out / f"{name}_snapshots"
    snapshots.mkdir()
    env = thread_env(threads) | {"PYTHONPATH": str(HERE / "sb_hook"), "PEER_SNAPSHOTS": str(snapshots),
                                 "PEER_POINTS": ",".join(f"{p:g}" for p in points)}
    proc, t0 = launch(cmd, cwd, env, out / f"{name}.log")
    meter = CpuMeter(proc.pid)
    wait_metered(proc, t0 + 60 * points[-1] + 600, meter)  # the batch in flight at the last point may take a while
    end_session(proc)
    if proc.returncode != 0:
        refuse(f"speechbrain's {name} ended with exit {proc.returncode} before the last point; see {out / f'{name}.log'}")
    kept = [json.loads(line) for line in (snapshots / "snapshots.jsonl").read_text().splitlines()]
    for k in kept:
        k["model"] = str(snapshots / f"CKPT+min{k['point']:g}")
    return kept, meter.seconds


def train(args) -> None:
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        refuse(f"{out} is not empty; give a new --out")
    if not args.threads.isdigit():
        refuse(f"--threads {args.threads}: a number of torch threads")
    if not (SB_PYTHON.is_file() and (SB_SSL / "train.py").is_file() and (SB_CTC / "train_with_bestrq.py").is_file()):
        refuse("SpeechBrain's environment or recipes are missing; run: bash benchmarks/speechbrain/setup.sh")
    points = sorted(float(p) for p in args.finetune_points.split(","))
    sys.path.insert(0, str(ROOT))
    from tools.corpus import resolve_data_dir

    out.mkdir(parents=True, exist_ok=True)
    data = Path(resolve_data_dir(None, None, args.corpus, "librispeech")).resolve()
    csvs = write_csvs(data, out, Path(args.subset))
    result = {"system": "speechbrain", "threads": args.threads, "data": str(data), "command": " ".join(sys.argv),
              "version": f"speechbrain 1.1.2, recipe {(SB / '.sb_repo' / 'SOURCE.txt').read_text().splitlines()[1]}",
              "pretrain_minutes": args.pretrain_minutes}
    no_workers = ["--num_workers", "0"]  # equal threads: torch threads only, no data-loading processes

    pt_path = "null"
    if args.pretrain_minutes > 0:
        yaml = edited_yaml(SB_SSL / "hparams" / "BEST-RQ.yaml", [
            ("    encoder_module: conformer\n", f"    encoder_module: conformer\n    kernel_size: {KERNEL}  # peers/selfsup.py\n"),
            ("    n_warmup_steps: 25000\n", f"    n_warmup_steps: {OUR_WARMUP}  # peers/selfsup.py: was 25000\n")],
            out / "BEST-RQ.yaml")
        cmd = [str(SB_PYTHON), "train.py", str(yaml), "--data_folder", str(data), "--output_folder", str(out / "pretrain"),
               "--train_csv", str(csvs["train"]), "--valid_csv", str(csvs["validation"]), "--skip_prep", "True",
               *[a for k, v in SIZE.items() for a in (f"--{k}", str(v))], "--max_batch_len", f"{OUR_BATCH_SECONDS:g}",
               "--avoid_if_shorter_than", "0.5", "--avoid_if_longer_than", "30.0", "--streaming", "False",
               "--train_dataloader_options", "{num_workers: 0}", "--test_dataloader_options", "{batch_size: 8, num_workers: 0}",
               # run options: what their hparams.update(run_opts) would otherwise reset to its defaults
               "--precision", "fp32", "--grad_accumulation_factor", "1", "--max_grad_norm", "10"]
        [kept], cpu_s = run_until(cmd, SB_SSL, args.threads, out, [args.pretrain_minutes], "pretrain")
        result["pretrain"] = kept | {"train_cpu_s": round(cpu_s)}
        pt_path = kept["model"]
        print(f"pre-training: model at {kept['minutes']:.2f} min, {kept['optimizer_steps']} steps", flush=True)

    yaml = edited_yaml(SB_CTC / "hparams" / "train_sb_BEST-RQ.yaml", [
        ("   encoder_module: !ref <encoder_module>\n",
         f"   encoder_module: !ref <encoder_module>\n   kernel_size: {KERNEL}  # peers/selfsup.py\n")], out / "train_sb_BEST-RQ.yaml")
    with open(csvs["10min"], newline="", encoding="utf-8") as f:
        alphabet = {c for row in csv.DictReader(f) for c in row["wrd"]}
    overrides = ["--data_folder", str(data), "--output_folder", str(out / "finetune"), "--skip_prep", "True",
                 "--train_csv", str(csvs["10min"]), "--valid_csv", str(csvs["validation"]), "--test_csv", f"[{csvs['test']}]",
                 "--pt_model_path", pt_path, "--pt_model_output_dim", str(SIZE["d_model"]),
                 *[a for k, v in SIZE.items() if k != "d_model" for a in (f"--{k}", str(v))],
                 "--output_neurons_ctc", str(len(alphabet) + 1), *no_workers,  # + the blank
                 "--precision", "fp32"]  # a run option (the YAML's fp16 is refused on a CPU)
    cmd = [str(SB_PYTHON), "train_with_bestrq.py", str(yaml), *overrides]
    kept, cpu_s = run_until(cmd, SB_CTC, args.threads, out, points, "finetune")
    result["finetune_cpu_s"] = round(cpu_s)
    for k in kept:
        k["hyps"] = str(out / "decode" / f"min{k['point']:g}.jsonl")
        Path(k["hyps"]).parent.mkdir(exist_ok=True)
        dec = subprocess.run([str(SB_PYTHON), str(HERE / "sb_decode.py"), "--recipe", "train_with_bestrq", str(yaml),
                              k["model"], k["hyps"], *overrides], cwd=SB_CTC, env=thread_env(args.threads),
                             capture_output=True, text=True)
        if dec.returncode != 0:
            refuse(f"decoding {k['model']} failed: {dec.stderr.strip()[-800:]}")
        k |= score(Path(k["hyps"]))
        print(f"fine-tuning {k['point']:g} min (model at {k['minutes']:.2f} min, {k['optimizer_steps']} steps): "
              f"CER {100 * k['cer']:.1f} %, WER {100 * k['wer']:.1f} %", flush=True)
    result["finetune"] = kept
    (out / "result.json").write_text(json.dumps(result, indent=1))


def report(args) -> None:
    results = load_results(args.runs)
    points = sorted({k["point"] for r in results for k in r["finetune"]})
    print("| system | pre-training | " + " | ".join(f"CER / WER @ {p:g} min of fine-tuning" for p in points) + " | version |")
    print("|---|---|" + "---|" * len(points) + "---|")
    for r in results:
        at = {k["point"]: k for k in r["finetune"]}
        pre = (f"{r['pretrain']['optimizer_steps']} steps in {r['pretrain_minutes']:g} min" if r.get("pretrain")
               else "none (random encoder)")
        cells = [f"{100 * at[p]['cer']:.1f} / {100 * at[p]['wer']:.1f} ({at[p]['optimizer_steps']} steps)" if p in at
                 else "–" for p in points]
        print(f"| {r['system']} | {pre} | " + " | ".join(cells) + f" | {r['version']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="their pre-training for the budget, then their fine-tuning; decode and score")
    t.add_argument("--threads", default="1", help="torch threads (no data-loading worker processes)")
    t.add_argument("--pretrain_minutes", type=float, default=64.0,
                   help="wall minutes of pre-training (ours: 12 000 steps in 64 min on one thread); 0: none")
    t.add_argument("--finetune_points", default="6.5,13",
                   help="minutes of fine-tuning at which the model is kept and decoded (ours: 2000 steps, 6.5 min)")
    t.add_argument("--corpus", default="ssl10h", help="built-in corpus profile (ssltiny for a smoke run)")
    t.add_argument("--subset", default=str(ROOT / "recipes" / "asr" / "subsets" / "10min.txt"),
                   help="the labelled utterance ids (the protocol's 10 min by default)")
    t.add_argument("--out", required=True, help="a new folder for this run")
    r = sub.add_parser("report", help="markdown table of finished runs")
    r.add_argument("runs", nargs="+", help="--out folders of `train`, or their result.json files")
    args = parser.parse_args()
    train(args) if args.command == "train" else report(args)


if __name__ == "__main__":
    main()
