"""One-GPU check of the BEST-RQ recipe: what the profiles promise, measured. A few minutes.

    python benchmarks/gpu_check.py                      # one CUDA GPU: every check, a table at the end
    python benchmarks/gpu_check.py --device cpu --smoke  # the parts a CPU can run, tiny sizes (CI)

(a) bf16 is really used: a few BEST-RQ steps under `--mixed_precision bf16` (accelerate's autocast),
    forward hooks record the dtype of every Linear/Conv1d weight and output inside the step.
(b) DDP and FSDP on 1 GPU: the recipe through `accelerate launch` with multi_gpu.yaml and fsdp.yaml
    (--num_processes 1), same seed and data; their per-step losses agree (bf16: within 2 %).
(c) interrupted == continuous with `--deterministic true`: SIGKILL after a checkpoint, re-run the
    same command; the final weights must be bit-identical (single_gpu.yaml, bf16).
(d) throughput in seconds of audio per second, model FLOP utilisation and peak memory, for BEST-RQ at
    the 960 h model size (recipes/best_rq/config_librispeech_960h.yaml: 24 × 1024 Conformer, batch
    800 s) on generated audio, a few dozen optimizer steps. FLOPs per step are counted with
    torch.utils.flop_counter (forward + backward of one step) and checked against 6 × parameters ×
    encoder frames; MFU divides by the GPU's dense bf16 peak (--peak_tflops, or the table below).

Measured on one H200 on 2026-11-27: the table is in the top README ("GPU check"), with what the
first run found (bf16 under FSDP2 has no autocast) and how it was mended. The CPU smoke path runs
in CI (tests/benchmarks/test_gpu_check.py).

Exit code: 0 every check passed (or was skipped, with its reason), 1 a check failed or the machine
cannot run the script (one line saying why).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "best_rq"
sys.path[:0] = [str(ROOT), str(RECIPE)]  # common/ and the recipe's own modules (model.py, data.py)

# Dense bf16 tensor-core peaks, FLOP/s (NVIDIA datasheets; the "with sparsity" figures are twice these).
# Matched against torch.cuda.get_device_name() in this order; other GPUs need --peak_tflops.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12)]

# Model sizes: `small` is the recipe's default encoder (config.yaml), `tiny` the tests' one.
SMALL = dict(hidden_size=144, num_layers=4, num_heads=4, ffn_dim=576, conv_kernel=15, codebook_size=8192)
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_dim=64, conv_kernel=7, codebook_size=64)


def model_args(size: dict) -> list[str]:
    return [a for k, v in size.items() for a in (f"--{k}", str(v))]


def refuse(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr)
    sys.exit(1)


# ------------------------------------------------------------------------------------------------
# Recipe runs through `accelerate launch` (b, c)
# ------------------------------------------------------------------------------------------------


def launch(profile: list[str], args: list[str], log: Path, *, kill_after_checkpoint: int | None = None) -> int:
    """Run recipes/best_rq/train.py under `accelerate launch <profile>`; output goes to `log`.

    With `kill_after_checkpoint=k` the run is SIGKILLed (its whole process group, as a scheduler
    would) as soon as checkpoint k is complete. Returns the exit code (-9 when killed)."""
    out = Path(args[args.index("--output_dir") + 1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *profile, str(RECIPE / "train.py"), *args]
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    marker = out / "checkpoints" / f"step_{kill_after_checkpoint or 0:08d}" / "COMPLETE"
    while proc.poll() is None:
        if kill_after_checkpoint is not None and marker.exists():
            # One process: `accelerate launch` starts train.py in its own process group (no elastic agent).
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -9
        time.sleep(0.05)  # polling interval, seconds
    return proc.returncode


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def startup_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if " run: " in line]
    return lines[-1].split(" run: ", 1)[1] if lines else "(no start-up line)"


def tail(log: Path, n: int = 3) -> str:
    return " | ".join(log.read_text().strip().splitlines()[-n:])


def check_ddp_vs_fsdp(opts, base: list[str]) -> tuple[str, str]:
    """(b): the same 8 steps under multi_gpu.yaml and fsdp.yaml, 1 process each."""
    if opts.device != "cuda":
        return "SKIP", ("needs a GPU: on CPU accelerate 1.15 does not make the FSDP profile FSDP and the recipe "
                        "refuses it; FSDP2 on CPU/gloo is tested with a test-only hook in tests/guarantees/test_fsdp.py")
    runs = {}
    for name, profile in (("ddp", "multi_gpu.yaml"), ("fsdp", "fsdp.yaml")):
        out, log = opts.output_dir / name, opts.output_dir / f"{name}.log"
        rc = launch(["--config_file", str(ROOT / "accelerate_configs" / profile), "--num_processes", "1",
                     "--main_process_port", str(free_port())],
                    [*base, "--output_dir", str(out), "--max_steps", "8", "--save_steps", "8"], log)
        if rc != 0:
            return "FAIL", f"{profile} exited {rc}: {tail(log)} (log: {log})"
        runs[name] = (losses(out), startup_line(log), out)
    (ddp, ddp_line, _), (fsdp, fsdp_line, fsdp_out) = runs["ddp"], runs["fsdp"]
    if not fsdp_line.startswith("FSDP2") or not ddp_line.startswith("DDP"):
        return "FAIL", f"the runs were not what the profiles say: ddp '{ddp_line}', fsdp '{fsdp_line}'"
    sharded = (fsdp_out / "checkpoints" / "step_00000008" / "pytorch_model_fsdp_0").is_dir()
    worst = max(abs(a - b) / abs(a) for a, b in zip(ddp, fsdp))
    # bf16: DDP computes with fp32 master weights under autocast, FSDP with bf16 copies (param_dtype).
    ok = len(ddp) == len(fsdp) == 8 and worst <= 0.02 and sharded
    return ("PASS" if ok else "FAIL"), (f"losses over 8 steps differ by ≤ {100 * worst:.2f} % (limit 2 %); "
                                        f"step 1: DDP {ddp[0]:.4f}, FSDP {fsdp[0]:.4f}; FSDP checkpoint "
                                        f"{'sharded (DCP)' if sharded else 'NOT sharded'}")


def check_exact_resume(opts, base: list[str]) -> tuple[str, str]:
    """(c): continuous vs SIGKILL after checkpoint 3 + re-run, with --deterministic true."""
    from safetensors.torch import load_file
    import torch

    if opts.device == "cuda":
        profile = ["--config_file", str(ROOT / "accelerate_configs" / "single_gpu.yaml")]
    else:  # plain CPU, fp32
        profile = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no"]
    steps = ["--max_steps", "6", "--save_steps", "1", "--deterministic", "true"]
    cont, cut = opts.output_dir / "continuous", opts.output_dir / "interrupted"
    log_c, log_i = opts.output_dir / "continuous.log", opts.output_dir / "interrupted.log"
    if (rc := launch(profile, [*base, *steps, "--output_dir", str(cont)], log_c)) != 0:
        return "FAIL", f"continuous run exited {rc}: {tail(log_c)} (log: {log_c})"
    if (rc := launch(profile, [*base, *steps, "--output_dir", str(cut)], log_i, kill_after_checkpoint=3)) != -9:
        return "FAIL", f"the run to interrupt ended before checkpoint 3 was complete (exit {rc}; log: {log_i})"
    if (rc := launch(profile, [*base, *steps, "--output_dir", str(cut)], log_i)) != 0:
        return "FAIL", f"resumed run exited {rc}: {tail(log_i)} (log: {log_i})"
    if "resumed from" not in log_i.read_text():
        return "FAIL", f"the re-run did not resume (log: {log_i})"
    a, b = load_file(cont / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    line = startup_line(log_c)
    if differ:
        return "FAIL", f"{len(differ)} of {len(a)} tensors differ (e.g. {differ[0]}); run: {line}"
    return "PASS", f"killed after step 3, resumed: {len(a)} tensors bit-identical after 6 steps; run: {line}"


# ------------------------------------------------------------------------------------------------
# In-process steps (a, d): the recipe's model and loss, accelerate's autocast, generated audio
# ------------------------------------------------------------------------------------------------


def generated_batch(n: int, seconds: float, cfg, seed: int = 0) -> dict:
    """`n` utterances of `seconds` of generated audio (gliding tones + noise, 16 kHz) → the recipe's
    batch: log-mels (n, frames, 80), masks and noise from its MaskingCollator."""
    import torch
    from data import MaskingCollator

    from common.model.features import LogMel

    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16000)) / 16000  # seconds
    logmel = LogMel(16000, cfg.n_mels)
    items = []
    for i in range(n):
        f0 = 100 + 200 * torch.rand(1, generator=g)  # Hz
        wave = 0.3 * torch.sin(2 * math.pi * f0 * t * (1 + 0.1 * t)) + 0.01 * torch.randn(t.shape, generator=g)
        items.append((f"gen-{i}", logmel(wave)))
    return MaskingCollator(cfg)(items)


def build(accelerator, size: dict, n_mels: int = 80, stack: int = 4):
    import torch
    from model import BestRQ

    from common.model.encoder import encoder_config

    enc = encoder_config(input_dim=n_mels * stack, hidden_size=size["hidden_size"], num_layers=size["num_layers"],
                         num_heads=size["num_heads"], ffn_dim=size["ffn_dim"], conv_kernel=size["conv_kernel"],
                         dropout=0.1)
    model = BestRQ(enc, n_mels=n_mels, stack_frames=stack, codebook_size=size["codebook_size"], code_dim=16,
                   quantizer_seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    return accelerator.prepare(model, optimizer)


def train_step(accelerator, model, optimizer, batch):
    """One optimizer step as the recipe takes it (no accumulation); returns the loss."""
    loss, *_ = model(batch["feats"], batch["feat_lens"], batch["mask"], batch["noise"])
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def check_bf16(accelerator, size: dict, cfg) -> tuple[str, str]:
    """(a): dtypes seen inside three training steps under accelerate's bf16 autocast."""
    import torch

    model, optimizer = build(accelerator, size)
    seen = []  # (module class, weight dtype, output dtype) per Linear/Conv1d call

    def hook(module, args, output):
        seen.append((type(module).__name__, module.weight.dtype, output.dtype))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))]
    batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in generated_batch(2, 4.0, cfg).items()}
    loss_dtypes = {train_step(accelerator, model, optimizer, batch).dtype for _ in range(3)}
    for h in handles:
        h.remove()
    outputs = sorted({str(o).removeprefix("torch.") for _, _, o in seen})
    weights = sorted({str(w).removeprefix("torch.") for _, w, _ in seen})
    master = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    bf16_out = sum(o == torch.bfloat16 for _, _, o in seen)
    ok = seen and bf16_out == len(seen) and loss_dtypes == {torch.float32} and master == ["float32"]
    detail = (f"{bf16_out}/{len(seen)} Linear/Conv1d outputs bf16 (output dtypes {outputs}, weights {weights} "
              f"cast per op by autocast); loss {sorted(str(d).removeprefix('torch.') for d in loss_dtypes)}; "
              f"master weights {master}")
    del model, optimizer
    return ("PASS" if ok else "FAIL"), detail


def measure_throughput(accelerator, opts, size: dict, cfg) -> dict:
    """(d): optimizer steps on one generated batch; seconds of audio per second, FLOPs, MFU, memory."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cuda = accelerator.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, optimizer = build(accelerator, size)
    n_utts = max(1, int(opts.batch_seconds // opts.utterance_seconds))
    batch = generated_batch(n_utts, opts.utterance_seconds, cfg)
    batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    audio_s = n_utts * opts.utterance_seconds  # seconds of audio per optimizer step
    frames = int(batch["feat_lens"].sum()) // 4  # encoder frames per step (40 ms each)
    params = sum(p.numel() for p in accelerator.unwrap_model(model).encoder.parameters())

    for _ in range(opts.warmup_steps):  # kernels selected, allocator warm
        train_step(accelerator, model, optimizer, batch)
    with FlopCounterMode(display=False) as counter:  # one step's forward + backward (+ clipping, optimizer)
        train_step(accelerator, model, optimizer, batch)
    flops = counter.get_total_flops()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    for _ in range(opts.steps):
        train_step(accelerator, model, optimizer, batch)
    sync()
    seconds = time.perf_counter() - start
    peak = None
    if cuda:
        name = torch.cuda.get_device_name()
        peak = opts.peak_tflops * 1e12 if opts.peak_tflops else next((f for k, f in PEAK_BF16 if k in name), None)
    steps_per_s = opts.steps / seconds
    return dict(
        model=f"{size['num_layers']} × {size['hidden_size']} Conformer, {params / 1e6:.3g} M encoder parameters",
        batch=f"{n_utts} × {opts.utterance_seconds:g} s = {audio_s:g} s of audio, {frames} encoder frames",
        audio_seconds_per_s=audio_s * steps_per_s,
        step_s=seconds / opts.steps,
        flops_per_step=flops,
        analytic_flops_per_step=6 * params * frames,  # 2 (forward) + 4 (backward) per weight per frame
        mfu=(flops * steps_per_s / peak) if peak else None,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        device=torch.cuda.get_device_name() if cuda else "cpu",
    )


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: needs --smoke")
    p.add_argument("--smoke", action="store_true", help="tiny model and batch, 3 timed steps (CPU or a quick look)")
    p.add_argument("--data_dir", default=None, help="LibriSpeech-layout root for (b), (c); default: built-in tiny corpus")
    p.add_argument("--output_dir", type=Path, default=ROOT / "outputs" / "gpu_check", help="must not exist yet")
    p.add_argument("--steps", type=int, default=None, help="(d) timed optimizer steps (default 30; smoke 3)")
    p.add_argument("--warmup_steps", type=int, default=3, help="(d) untimed optimizer steps first")
    p.add_argument("--batch_seconds", type=float, default=None,
                   help="(d) seconds of audio per step (default: the 960 h config's max_batch_seconds; smoke 8)")
    p.add_argument("--utterance_seconds", type=float, default=16.0, help="(d) length of each generated utterance")
    p.add_argument("--peak_tflops", type=float, default=None, help="(d) the GPU's dense bf16 peak, for MFU")
    opts = p.parse_args(argv)
    if opts.device == "cpu":  # also on a machine with a GPU: this process and the runs it launches
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

    import torch
    import yaml

    if opts.device == "cuda" and not torch.cuda.is_available():
        refuse("no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a machine with one, "
               "or `--device cpu --smoke` for the parts a CPU can run")
    if opts.device == "cpu" and not opts.smoke:
        refuse("--device cpu needs --smoke: the 960 h model size is a GPU measurement")
    if opts.output_dir.exists() and any(opts.output_dir.iterdir()):
        refuse(f"--output_dir {opts.output_dir} is not empty; remove it or pass another (runs in it would resume)")
    opts.output_dir.mkdir(parents=True, exist_ok=True)

    big = yaml.safe_load((RECIPE / "config_librispeech_960h.yaml").read_text())
    if opts.smoke:
        run_size, bench_size = TINY, TINY
        opts.steps = opts.steps or 3
        opts.batch_seconds = opts.batch_seconds or 8.0
        opts.utterance_seconds = min(opts.utterance_seconds, 4.0)
    else:
        run_size, bench_size = SMALL, {k: big[k] for k in TINY}
        opts.steps = opts.steps or 30
        opts.batch_seconds = opts.batch_seconds or float(big["max_batch_seconds"])
    data = ["--data_dir", opts.data_dir] if opts.data_dir else ["--builtin_corpus", "tiny"]
    base = [*data, *model_args(run_size), "--max_batch_seconds", "16", "--warmup_steps", "5", "--logging_steps", "1",
            "--eval_steps", "0", "--report_to", "none", "--seed", "42", "--mask_prob", "0.05"]
    cfg = SimpleNamespace(n_mels=80, stack_frames=4, mask_span_ms=400.0, mask_prob=0.05, noise_std=0.1, seed=42)

    rows = []
    rows.append(("(b) DDP vs FSDP, 1 GPU", *check_ddp_vs_fsdp(opts, base)))
    rows.append(("(c) interrupted == continuous", *check_exact_resume(opts, base)))

    from common.training.distributed import build_accelerator

    accelerator = build_accelerator(mixed_precision="bf16")
    rows.insert(0, ("(a) bf16 used", *check_bf16(accelerator, run_size, cfg)))
    try:
        m = measure_throughput(accelerator, opts, bench_size, cfg)
    except torch.cuda.OutOfMemoryError:
        rows.append(("(d) throughput", "FAIL", f"out of GPU memory with {opts.batch_seconds:g} s of audio per step: "
                                               f"re-run with a smaller --batch_seconds"))
        return print_table(rows, opts, "cuda", torch.__version__)
    if m["mfu"] is not None:
        mfu = f"{100 * m['mfu']:.1f} % of the dense bf16 peak"
    else:
        mfu = "n/a (CPU)" if opts.device == "cpu" else "n/a (GPU not in PEAK_BF16: pass --peak_tflops)"
    mem = f"{m['peak_memory_gib']:.1f} GiB" if m["peak_memory_gib"] is not None else "n/a (CPU)"
    rows.append(("(d) throughput", "MEASURED",
                 f"{m['audio_seconds_per_s']:.1f} s of audio/s ({m['step_s'] * 1000:.0f} ms/step); {m['model']}; "
                 f"batch {m['batch']}; bf16 on {m['device']}"))
    rows.append(("(d) FLOPs, MFU", "MEASURED",
                 f"{m['flops_per_step'] / 1e9:.4g} GFLOP/step counted (6·N·frames: "
                 f"{m['analytic_flops_per_step'] / 1e9:.4g}); MFU {mfu}"))
    rows.append(("(d) peak memory", "MEASURED", f"{mem} (torch.cuda.max_memory_allocated, timed steps)"))

    return print_table(rows, opts, m["device"], torch.__version__)


def print_table(rows: list[tuple[str, str, str]], opts, device: str, torch_version: str) -> int:
    """Print the result table; the exit code: 1 if a check failed."""
    width = max(len(r[0]) for r in rows)
    print(f"\nBEST-RQ GPU check — {'smoke (tiny sizes)' if opts.smoke else 'full'}, device {device}, "
          f"torch {torch_version}; logs in {opts.output_dir}")
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<8}  {detail}")
    return 1 if any(status == "FAIL" for _, status, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
