"""BEST-RQ end to end, through `accelerate launch`: interrupted == continuous, sharding, rank discipline."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from common.data.manifest import read_librispeech
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import (SUPPORT, assert_same_losses, assert_same_weights, epoch_lengths, last_flag_wins,
                                   metrics, resumed_positions, run)

pytestmark = pytest.mark.slow

SEED = 42
TINY = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64",
        "--conv_kernel", "7", "--codebook_size", "64", "--warmup_steps", "5", "--logging_steps", "1",
        "--eval_steps", "4", "--report_to", "none", "--seed", str(SEED), "--mask_prob", "0.05",
        "--stats_utterances", "8"]  # 8 of the 48 training utterances (the default, 500, reads all 48 at each fresh start)


best_rq = recipe_modules("best_rq", "data", "model")


def train_durations(corpus: Path) -> list[float]:
    return read_librispeech(corpus / "librispeech", "train")["duration"]


def args_for(corpus: Path, out: Path, *extra: str) -> list[str]:
    return last_flag_wins(["--data_dir", str(corpus / "librispeech"), "--output_dir", str(out), *TINY, *extra])


# ---------------------------------------------------------------------------------------------
# Unit tests of the quantizer and masking
# ---------------------------------------------------------------------------------------------


def test_quantizer_is_frozen_deterministic_unit_norm():
    model = best_rq.model
    q = model.RandomProjectionQuantizer(320, 16, 1024, seed=7)
    assert not list(q.parameters())  # buffers only: never trained, saved with the weights
    assert torch.equal(q.codebook, model.RandomProjectionQuantizer(320, 16, 1024, seed=7).codebook)
    assert not torch.equal(q.codebook, model.RandomProjectionQuantizer(320, 16, 1024, seed=8).codebook)
    torch.manual_seed(0)  # the global RNG must not matter
    assert torch.equal(q.projection, model.RandomProjectionQuantizer(320, 16, 1024, seed=7).projection)
    x = torch.randn(4, 50, 320)
    assert torch.allclose(q.project(x).norm(dim=-1), torch.ones(4, 50), atol=1e-5)
    assert torch.allclose(q.codebook.norm(dim=-1), torch.ones(1024), atol=1e-5)
    labels = q(x)
    assert labels.shape == (4, 50) and labels.dtype == torch.long
    assert labels.min() >= 0 and labels.max() < 1024
    # nearest code in l2 distance == argmax of cosine similarity
    dist = torch.cdist(q.project(x).reshape(-1, 16), q.codebook)
    assert torch.equal(dist.argmin(-1), labels.reshape(-1))
    assert len(labels.unique()) > 100  # random projections spread over the codebook


def test_quantizer_labels_do_not_depend_on_autocast():
    """A bf16 run (accelerate wraps forward in autocast) gets the float32 labels: the targets are a
    property of the data, not of the run's precision."""
    q = best_rq.model.RandomProjectionQuantizer(320, 16, 8192, seed=1234)
    x = torch.randn(4000, 320, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        labels = q(x)
    assert torch.equal(labels, q(x))


@pytest.mark.parametrize("source", ["config_librispeech_960h.yaml", "Config"])
def test_paper_masking_masks_the_papers_fraction(source):
    """The paper draws span starts with p = 0.01 per 10 ms frame, 400 ms spans: 1 - 0.99^40 = 33 % of
    the frames masked. This recipe draws per 40 ms position, so the LibriSpeech config and the Config
    default must say 1 - 0.99^4 per position, not 0.01 (which masks 10 %)."""
    if source == "Config":
        default = recipe_modules("best_rq", "train").train.Config()
        cfg = dict(mask_prob=default.mask_prob, mask_span_ms=default.mask_span_ms)
    else:
        cfg = yaml.safe_load((Path(best_rq.data.__file__).parent / source).read_text())
    cfg = SimpleNamespace(stack_frames=4, n_mels=8, noise_std=0.1, seed=0, **{
        k: cfg[k] for k in ("mask_prob", "mask_span_ms")})
    collate = best_rq.data.MaskingCollator(cfg)
    batch = collate([(f"utt{i}", torch.zeros(1200, 8)) for i in range(400)])  # 400 × 12 s
    assert abs(batch["mask"].float().mean().item() - (1 - 0.99 ** 40)) < 0.02


def test_span_mask_fraction_and_determinism():
    model = best_rq.data
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    m = model.span_mask(100_000, 0.01, 10, g())
    assert torch.equal(m, model.span_mask(100_000, 0.01, 10, g()))
    expected = 1 - (1 - 0.01) ** 10  # a position is masked if any of the 10 before it started a span
    assert abs(m.float().mean().item() - expected) < 0.01
    runs = torch.diff(torch.nonzero(torch.diff(m.int())).flatten())
    assert runs.min() >= 1
    assert model.span_mask(5, 0.0, 3, g()).sum() >= 1  # never an utterance without a masked label


def test_masked_loss_starts_near_chance():
    from common.model.encoder import encoder_config

    cfg = encoder_config(input_dim=320, hidden_size=32, num_layers=1, num_heads=2, ffn_dim=64,
                         conv_kernel=7, dropout=0.0)
    m = best_rq.model.BestRQ(cfg, n_mels=80, stack_frames=4, codebook_size=256, code_dim=16, quantizer_seed=0)
    feats = torch.randn(2, 200, 80)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[:, 10:20] = True
    loss, acc, n, pred, target = m(feats, torch.tensor([200, 160]), mask, torch.zeros_like(feats))
    assert pred.shape == (20,)
    assert n == 20 and abs(loss.item() - math.log(256)) < 1.0
    # labels are computed from the clean input: the noise put into masked frames does not change them
    labels = []
    m.quantizer.register_forward_hook(lambda module, args, out: labels.append(out))
    m(feats, torch.tensor([200, 160]), mask, torch.zeros_like(feats))
    m(feats, torch.tensor([200, 160]), mask, 5 * torch.randn_like(feats))
    assert torch.equal(labels[0], labels[1])
    x = (feats - m.feat_mean) / m.feat_std
    assert torch.equal(labels[0], m.quantizer(x.reshape(2, 50, 320)))


def test_utterance_label_norm_ignores_level_and_padding():
    """label_norm utterance: each utterance's own per-bin statistics over its valid frames feed the
    quantizer, so a level change (a constant added to the log-mel) and the batch's padding leave the
    labels unchanged; the global statistics do neither."""
    from common.model.encoder import encoder_config

    cfg = encoder_config(input_dim=320, hidden_size=32, num_layers=1, num_heads=2, ffn_dim=64,
                         conv_kernel=7, dropout=0.0)
    models = {norm: best_rq.model.BestRQ(cfg, n_mels=80, stack_frames=4, codebook_size=256, code_dim=16,
                                         quantizer_seed=0, label_norm=norm) for norm in ("global", "utterance")}
    feats = torch.randn(1, 160, 80) * torch.linspace(0.5, 2, 80) + torch.linspace(-3, 3, 80)
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[:, 5:15] = True

    def labels(model, x, lens, m):
        out = []
        hook = model.quantizer.register_forward_hook(lambda module, args, o: out.append(o))
        model(x, lens, m, torch.zeros_like(x))
        hook.remove()
        return out[0]

    one = labels(models["utterance"], feats, torch.tensor([160]), mask)
    louder = labels(models["utterance"], feats + 2.3, torch.tensor([160]), mask)  # +10 dB
    padded = torch.cat([feats, torch.full((1, 80, 80), -13.8)], 1)  # beside a longer utterance
    in_batch = labels(models["utterance"], torch.cat([padded, torch.randn(1, 240, 80)]), torch.tensor([160, 240]),
                      torch.cat([torch.cat([mask, torch.zeros(1, 20, dtype=torch.bool)], 1)] * 2))
    assert torch.equal(one, louder) and torch.equal(one[0], in_batch[0, :40])
    g = labels(models["global"], feats, torch.tensor([160]), mask)
    assert not torch.equal(g, labels(models["global"], feats + 2.3, torch.tensor([160]), mask))


def test_evaluate_reports_the_label_entropy():
    """eval_label_entropy: the loss of predicting the masked labels' own frequencies (the level of a
    model that learned nothing from the audio), computed over every validation batch."""
    from types import SimpleNamespace

    from common.model.encoder import encoder_config

    cfg = encoder_config(input_dim=320, hidden_size=32, num_layers=1, num_heads=2, ffn_dim=64,
                         conv_kernel=7, dropout=0.0)
    m = best_rq.model.BestRQ(cfg, n_mels=80, stack_frames=4, codebook_size=16, code_dim=16, quantizer_seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [{"feats": torch.randn(2, 200, 80, generator=g), "feat_lens": torch.tensor([200, 120]),
                "mask": torch.rand(2, 50, generator=g) < 0.5, "noise": torch.zeros(2, 200, 80)} for _ in range(3)]
    labels = torch.cat([m(**b)[4] for b in batches])
    p = torch.bincount(labels, minlength=16).float() / len(labels)
    expected = -(p[p > 0] * p[p > 0].log()).sum().item()
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda x, op: x, unwrap_model=lambda model: model)
    out = best_rq.model.evaluate(m, batches, accelerator)
    assert abs(out["eval_label_entropy"] - expected) < 1e-5 and 1.0 < expected < math.log(16)
    assert 0 < out["eval_codes_used"] <= 1 and out["eval_code_perplexity"] >= 1


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.accelerate_launch
@pytest.mark.parametrize("nproc", [1, 2])
def test_interrupted_equals_continuous(tiny_corpus, tmp_path, nproc):
    """Two SIGKILLs: one inside epoch 0, one inside epoch ≥ 1; same weights and per-step losses, also
    when the last leg loads its data in worker processes."""
    mbs = 16.0
    e0, e1, _ = epoch_lengths(train_durations(tiny_corpus), mbs, nproc, 3)
    assert e0 >= 4 and e1 >= 4
    k1, k2, max_steps = 2, e0 + 2, e0 + e1 + 2
    extra = ["--max_batch_seconds", str(mbs), "--max_steps", str(max_steps), "--save_steps", "1",
             "--save_total_limit", "3"]

    cont = tmp_path / "continuous"
    run("best_rq", nproc, args_for(tiny_corpus, cont, *extra), launcher=False)  # the reference: forked (the guarantee is the cut run's)

    cut = tmp_path / "interrupted"
    run("best_rq", nproc, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k1, launcher=nproc == 1)  # harness.KILL_LEG
    run("best_rq", nproc, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k2, launcher=False)  # a middle leg: forked
    # The last leg reads its data in 2 worker processes (the others: none); batches, masks and noise
    # must not depend on that, nor on the workers' epoch copies of the sampler and collator.
    run("best_rq", nproc, args_for(tiny_corpus, cut, *extra, "--num_workers", "2"))

    resumes = resumed_positions(tmp_path / "interrupted.log")
    assert len(resumes) == 2
    (s1, ep1, b1), (s2, ep2, b2) = resumes
    assert ep1 == 0 and b1 > 0, resumes  # the first cut was inside epoch 0
    assert ep2 >= 1 and b2 > 0, resumes  # the second inside a later epoch
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    assert [r["step"] for r in metrics(cut)] == list(range(1, max_steps + 1))  # each step once


@pytest.mark.parametrize("nproc", [1, 2])
def test_interrupted_equals_continuous_with_accumulation(tiny_corpus, tmp_path, nproc):
    """--gradient_accumulation_steps 3, cut inside epoch 1. The sampler makes each epoch's batch count a
    multiple of the global batch (processes × 3) by splitting batches, so no window is ever short."""
    accum, mbs = 3, 16.0
    e0, e1 = epoch_lengths(train_durations(tiny_corpus), mbs, nproc, 2, accumulation=accum)
    assert e0 % accum == 0 and e1 % accum == 0
    steps0 = e0 // accum
    k, max_steps = steps0 + 1, steps0 + e1 // accum
    extra = ["--max_batch_seconds", str(mbs), "--gradient_accumulation_steps", str(accum),
             "--max_steps", str(max_steps), "--save_steps", "1"]

    cont = tmp_path / "continuous"
    run("best_rq", nproc, args_for(tiny_corpus, cont, *extra))
    cut = tmp_path / "interrupted"
    run("best_rq", nproc, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k)
    run("best_rq", nproc, args_for(tiny_corpus, cut, *extra))

    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    assert epoch == 1 and batch % accum == 0 and batch > 0  # resumed at a window boundary in epoch 1
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)


def test_ddp_shards_disjoint_and_only_rank0_writes(tiny_corpus, tmp_path):
    """2 processes: each epoch's ids are disjoint across ranks and cover the training set; the
    shared files (weights, optimizer, metrics, config, markers) are written by rank 0 alone."""
    out = tmp_path / "run"
    audit = tmp_path / "audit"
    audit.mkdir()
    e0, e1, _ = epoch_lengths(train_durations(tiny_corpus), 16.0, 2, 3)
    run("best_rq", 2, args_for(tiny_corpus, out, "--max_batch_seconds", "16", "--max_steps", str(e0 + e1),
                               "--save_steps", "3", "--dump_batch_ids", "true", "--report_to", "tensorboard"),
        env={"AUDIT_WRITES_DIR": str(audit), "PYTHONPATH": str(SUPPORT)})

    all_ids = set(read_librispeech(tiny_corpus / "librispeech", "train")["id"])
    per_rank = {}
    for r in (0, 1):
        rows = [json.loads(line) for line in (out / f"batch_ids.rank{r}.jsonl").read_text().splitlines()]
        per_rank[r] = rows
    for epoch, n in ((0, e0), (1, e1)):
        ids = [[i for row in per_rank[r] if row["epoch"] == epoch for i in row["ids"]] for r in (0, 1)]
        assert len([row for row in per_rank[0] if row["epoch"] == epoch]) == n
        assert len([row for row in per_rank[1] if row["epoch"] == epoch]) == n  # same steps
        assert not set(ids[0]) & set(ids[1]), f"epoch {epoch}: ranks share samples"
        assert len(ids[0]) + len(ids[1]) == len(all_ids) and set(ids[0]) | set(ids[1]) == all_ids

    writes = {}
    for f in audit.iterdir():
        writes.setdefault(f.name.split(".")[0], set()).update(f.read_text().split())
    rank1 = {str(Path(p).relative_to(out)) for p in writes["1"] if p.startswith(str(out))}
    # Rank 1 may write its RNG file, its own id log, and data preparation (whichever process
    # arrives first validates the manifest under a lock); nothing of a checkpoint's shared state.
    allowed = re.compile(r"^(checkpoints/\.step_\d{8}\.tmp/random_states_1\.pkl|batch_ids\.rank1\.jsonl|data/.*)$")
    assert rank1 and all(allowed.match(p) for p in rank1), sorted(rank1)
    rank0 = {Path(p).name for p in writes["0"]}
    assert {"model.safetensors", "optimizer.bin", "COMPLETE", "metrics.jsonl", "random_states_0.pkl"} <= rank0
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    rows = metrics(out, timings=True)
    assert [r["step"] for r in rows] == list(range(1, e0 + e1 + 1))
    assert all(r["audio_s_per_s"] > 0 for r in rows)  # the whole job's rate, both ranks' audio
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "config.yaml").exists()
    from transformers import Wav2Vec2BertModel

    Wav2Vec2BertModel.from_pretrained(out / "final" / "encoder")  # the ecosystem can load it


def test_resume_keeps_the_checkpoints_thread_count(tiny_corpus, tmp_path):
    """On CPU the weights depend on the threads per process (float sums are split by thread), so
    an automatic re-launch takes the checkpoint's count, whatever this machine would pick."""
    extra = ["--max_batch_seconds", "16", "--max_steps", "6", "--save_steps", "1", "--hidden_size", "64",
             "--ffn_dim", "256"]
    one, two = tmp_path / "one_thread", tmp_path / "two_threads"
    run("best_rq", 1, args_for(tiny_corpus, one, *extra, "--num_threads", "1"))
    run("best_rq", 1, args_for(tiny_corpus, two, *extra, "--num_threads", "2"))
    with pytest.raises(AssertionError):  # the premise: the thread count changes the result
        assert_same_weights(one, two)

    cut = tmp_path / "interrupted"
    run("best_rq", 1, args_for(tiny_corpus, cut, *extra, "--num_threads", "1"), kill_after_checkpoint=3)
    log = run("best_rq", 1, args_for(tiny_corpus, cut, *extra), env={"OMP_NUM_THREADS": "2"})  # auto would be 2
    assert "1 thread(s) per process (kept from the checkpoint)" in log
    assert_same_weights(one, cut)


def test_a_run_shorter_than_eval_steps_validates_at_the_end(tiny_corpus, tmp_path):
    """--max_steps 3 below --eval_steps 250: the last step is validated (the card's "last validation"
    was "(none logged)"). That validation changes no training: extended by a second launch to 5 steps,
    the run ends with the weights and losses of one that ran 5 at once; its card lists both launches."""
    tiny = [a if prev != "--eval_steps" else "250" for prev, a in zip(["", *TINY], TINY)]
    args = lambda out, steps: ["--data_dir", str(tiny_corpus / "librispeech"), "--output_dir", str(out), *tiny,  # noqa: E731
                               "--max_batch_seconds", "16", "--save_steps", "1", "--max_steps", str(steps)]
    cont, cut = tmp_path / "continuous", tmp_path / "extended"
    run("best_rq", 1, args(cont, 5))
    run("best_rq", 1, args(cut, 3))
    assert metrics(cut)[-1]["step"] == 3 and "eval_loss" in metrics(cut)[-1]
    assert '- last validation: `{"step": 3' in (cut / "final" / "README.md").read_text()
    run("best_rq", 1, args(cut, 5))

    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    assert [r["step"] for r in metrics(cont) if "eval_loss" in r] == [5]
    assert [r["step"] for r in metrics(cut) if "eval_loss" in r] == [3, 5]
    assert metrics(cont)[-1]["eval_loss"] == metrics(cut)[-1]["eval_loss"]
    card = (cut / "final" / "README.md").read_text()
    assert "- commands: 2 launches" in card and '- last validation: `{"step": 5' in card
    steps = re.findall(r"  - steps (\d+)–(\d+): `accelerate launch \S+train\.py .*--max_steps (\d+)`", card)
    assert steps == [("0", "3", "3"), ("3", "5", "5")], card
