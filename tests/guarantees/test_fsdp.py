"""BEST-RQ under accelerate's own FSDP2 code path, on CPU/gloo in 2 processes, with the settings of
accelerate_configs/fsdp.yaml (fsdp_version 2, one shard unit per Conformer block, SHARDED_STATE_DICT,
reshard after forward).

Accelerate 1.15 makes a CPU launch of that profile plain DDP (state.py turns ACCELERATE_USE_FSDP into
FSDP only for accelerator devices), so these tests set FORCE_FSDP_ON_CPU=1: the test-only hook in
support/sitecustomize.py takes that one decision as accelerate does on GPUs. From there on everything
is accelerate's and torch's code: prepare → fully_shard, clip_grad_norm_ on DTensor gradients,
save_state/load_state through torch.distributed.checkpoint, the gathered state dict for the export.
Without the hook the profile is refused on CPU (test_profiles.py).

Precision: fp32 for the exactness test (`--mixed_precision no` overrides the profile's bf16).
bf16 is the profile's own setting and is checked separately: accelerate's FSDP2 path uses no
autocast, only MixedPrecisionPolicy (weights bf16 inside the step, every shard unit's inputs and
outputs cast to bf16), so a model that feeds an fp32 tensor (features normalized by fp32 buffers,
sinusoid tables) into a bf16 layer, or a bf16 output into CTC, fails. Found on an H200
(benchmarks/gpu_check.py (b): "expected scalar type Float but found BFloat16" in the encoder's
input LayerNorm); CPU/gloo fails the same way, so the ASR and TTS steps run here in bf16 too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness.harness import (ROOT, SUPPORT, assert_same_losses, assert_same_weights, epoch_lengths, metrics,
                                   resumed_positions, run)
from tests.recipes import test_asr, test_tts
from tests.recipes.test_best_rq import args_for, best_rq, train_durations

pytestmark = pytest.mark.slow

FSDP = {"FORCE_FSDP_ON_CPU": "1", "PYTHONPATH": str(SUPPORT)}
MBS = 16.0  # seconds of audio per batch per process


def fsdp(corpus: Path, out: Path, max_steps: int, **kwargs) -> str:
    args = args_for(corpus, out, "--max_batch_seconds", str(MBS), "--max_steps", str(max_steps), "--save_steps", "1",
                    "--save_total_limit", "2", "--mixed_precision", "no")
    return run("best_rq", 2, args, profile="fsdp.yaml", **{"env": FSDP, **kwargs})


def test_fsdp_interrupted_equals_continuous_sharded_checkpoints_full_export(tiny_corpus, tmp_path):
    """One SIGKILL inside epoch 0, a NaN loss on rank 1 at step 2 (before the kill) in both runs:
    bit-identical final weights and per-step losses; sharded checkpoints; a complete final/."""
    e0, _ = epoch_lengths(train_durations(tiny_corpus), MBS, 2, 2)
    assert e0 >= 4
    kill, max_steps = 3, e0 + 2  # the cut is inside epoch 0, the run ends inside epoch 1
    nan = {**FSDP, "INJECT_FAULT": "nan:1:2"}  # rank 1's 2nd backward: its gradient shards are NaN

    cont = tmp_path / "continuous"
    log = fsdp(tiny_corpus, cont, max_steps, env=nan)
    assert "run: FSDP2, 2 process(es) on cpu" in log
    assert "step 2: non-finite gradient norm, update skipped (1 in a row, 1 in total)" in log

    cut = tmp_path / "interrupted"
    fsdp(tiny_corpus, cut, max_steps, env=nan, kill_after_checkpoint=kill)
    fsdp(tiny_corpus, cut, max_steps)
    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    assert step >= kill and epoch == 0 and batch > 0
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    for out in (cont, cut):  # the skipped update on every rank: the norm was made whole first
        assert [r["skipped_updates"] for r in metrics(out)] == [0] + [1] * (max_steps - 1)
        assert [r["step"] for r in metrics(out)] == list(range(1, max_steps + 1))

    # Checkpoints are sharded: each rank wrote its own part of the weights and of the optimizer.
    ckpt = cont / "checkpoints" / f"step_{max_steps:08d}"
    names = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    assert not {"model.safetensors", "optimizer.bin"} & names, names
    full_bytes = sum(v.numel() * v.element_size() for v in load_file(cont / "final" / "model.safetensors").values())
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{folder}/.metadata", f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp"} <= names, names
    for rank in (0, 1):  # a real shard (a quarter of the weights at least), not an empty file
        assert (ckpt / "pytorch_model_fsdp_0" / f"__{rank}_0.distcp").stat().st_size > full_bytes / 4
    marked = json.loads((ckpt / "COMPLETE").read_text())["files"]
    assert set(marked) == names - {"COMPLETE"}  # the digests cover every shard

    # final/: the full (gathered) weights, the same names and shapes as an unsharded model's.
    weights = load_file(cut / "final" / "model.safetensors")
    model = best_rq.model.BestRQ(_encoder_config(), n_mels=80, stack_frames=4, codebook_size=64, code_dim=16,
                                 quantizer_seed=1234)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not torch.equal(weights["feat_mean"], torch.zeros(80))  # the statistics reached the buffers
    from transformers import Wav2Vec2BertModel

    encoder = Wav2Vec2BertModel.from_pretrained(cut / "final" / "encoder")
    for k, v in encoder.state_dict().items():
        assert torch.equal(v, weights[f"encoder.{k}"]), k


@pytest.mark.parametrize("recipe", ["asr", "tts"])
def test_fsdp_bf16_steps_train_asr_and_tts(recipe, tiny_corpus, tmp_path):
    """The profile as it is (bf16): 3 steps, an evaluation and the gathered export, finite throughout."""
    out = tmp_path / recipe
    module = {"asr": test_asr, "tts": test_tts}[recipe]
    profile = ROOT / "accelerate_configs" / "fsdp.yaml"
    if recipe == "tts":  # the profile's shard unit is the Conformer block; the TTS's is FFTBlock (README)
        profile = tmp_path / "fsdp_tts.yaml"
        text = (ROOT / "accelerate_configs" / "fsdp.yaml").read_text()
        assert "cls_to_wrap: Wav2Vec2BertEncoderLayer" in text
        profile.write_text(text.replace("cls_to_wrap: Wav2Vec2BertEncoderLayer", "cls_to_wrap: FFTBlock"))
    args = module.args_for(tiny_corpus, out, "--max_steps", "3", "--save_steps", "3", "--eval_steps", "3")
    if recipe in ("asr", "tts"):  # config.yaml's weight average needs whole parameters: refused in one line, with the fix
        refused = run(recipe, 2, args, profile=str(profile), env=FSDP, expect_rc=1)
        assert ("error: --ema_decay averages whole parameters, and under FSDP each process holds a shard of them: "
                "train with DDP or one process, or set --ema_decay 0") in refused
        assert not (out / "checkpoints").exists()
        args += ["--ema_decay", "0"]
    log = run(recipe, 2, args, profile=str(profile), env=FSDP)
    assert "run: FSDP2, 2 process(es) on cpu" in log and "precision bf16" in log
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    weights = load_file(out / "final" / "model.safetensors")
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in weights.values())  # fp32 masters


def _encoder_config():
    from common.model.encoder import encoder_config

    # test_best_rq.TINY's encoder
    return encoder_config(input_dim=320, hidden_size=32, num_layers=2, num_heads=2, ffn_dim=64, conv_kernel=7,
                          dropout=0.1)
