"""TTS (aligned FastSpeech + Griffin-Lim): unit tests of the alignment pieces (beta-binomial prior,
forward-sum loss, monotonic alignment search against brute force, length regulation, symbols, MCD,
PNG); end to end through `accelerate launch` in 1 and 2 processes: smoke runs, interrupted ==
continuous, synthesize.py and score.py on the trained checkpoint."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile as sf
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from common.training.averaging import checkpoint_weights
from common.training.sealing import seal_export
from common.data.manifest import read_ljspeech
from tests.harness.recipe_import import recipe_modules
from tests.recipes.test_asr import short_run
from tests.harness.harness import (ROOT, assert_same_losses, assert_same_weights, epoch_lengths, last_flag_wins,
                                   metrics, python, resumed_positions, run)
from tests.tools.test_report import assert_page_rows, read_page

SEED = 42
RECIPE = ROOT / "recipes" / "tts"
TINY_MODEL = ["--dim", "32", "--ffn_dim", "64", "--duration_channels", "32", "--attention_dim", "32", "--num_heads", "2",
              "--warmup_steps", "5", "--logging_steps", "1", "--report_to", "none", "--seed", str(SEED),
              "--num_valid", "2", "--num_test", "2", "--max_batch_seconds", "16", "--stats_utterances", "20",
              "--binarization_start_steps", "3", "--learning_rate", "3e-3"]
# Characters, from scratch: config.yaml's phonemes and built-in base for a voice of one's own are tested on their own
TINY = [*TINY_MODEL, "--text_frontend", "characters", "--symbols", " abcdefghijklmnopqrstuvwxyz'.,;:?!-\"()",
        "--init_from", "none"]
slow = pytest.mark.slow


tts = recipe_modules("tts", "audio", "data", "model")
model, audio = tts.model, tts.audio


def args_for(corpus: Path, out: Path, *extra: str) -> list[str]:
    return last_flag_wins(["--data_dir", str(corpus / "ljspeech"), "--output_dir", str(out), *TINY, *extra])


# ---------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------


def test_beta_binomial_prior_shape_and_normalization():
    T, N = 40, 9
    p = model.beta_binomial_prior(T, N, scaling=1.0)
    assert p.shape == (T, N) and (p > 0).all()
    assert torch.allclose(p.sum(1), torch.ones(T), atol=1e-5)  # a distribution over symbols per frame
    modes = p.argmax(1)
    assert modes[0] == 0 and modes[-1] == N - 1 and (torch.diff(modes) >= 0).all()  # along the diagonal
    assert torch.allclose(p, p.flip(0).flip(1), atol=1e-6)  # symmetric under reversing both axes
    sharp = model.beta_binomial_prior(T, N, scaling=5.0)  # larger ω: more mass on the diagonal
    assert sharp.max(1).values.mean() > p.max(1).values.mean()


def _ctc(logprob_rows: list[torch.Tensor], blank: float) -> torch.Tensor:
    """Pad (T_b, N_b) log-prob matrices into a batch and return the forward-sum loss."""
    T = max(r.shape[0] for r in logprob_rows)
    N = max(r.shape[1] for r in logprob_rows)
    batch = torch.full((len(logprob_rows), T, N), model.NEG)
    for b, r in enumerate(logprob_rows):
        batch[b, : r.shape[0], : r.shape[1]] = r
    lens = lambda i: torch.tensor([r.shape[i] for r in logprob_rows])  # noqa: E731
    return model.forward_sum_loss(batch, lens(1), lens(0), blank_logprob=blank)


def test_forward_sum_loss_known_values():
    N = 5
    diagonal = torch.full((N, N), model.NEG).fill_diagonal_(0.0)
    assert _ctc([diagonal], blank=model.NEG).item() < 1e-5  # the only path has probability 1
    # With the default blank score −1 each frame keeps 1 / (1 + e^−1) for its symbol.
    assert math.isclose(_ctc([diagonal], blank=-1.0).item(), math.log(1 + math.exp(-1)), rel_tol=1e-5)
    uniform = torch.full((N, N), -math.log(N))
    assert math.isclose(_ctc([uniform], blank=model.NEG).item(), math.log(N), rel_tol=1e-5)
    # T = 8 frames, N = 3 symbols, uniform: C(7, 2) monotonic paths of probability 3^−8, per symbol.
    expected = -(math.log(math.comb(7, 2)) - 8 * math.log(3)) / 3
    uniform83 = torch.full((8, 3), -math.log(3))
    assert math.isclose(_ctc([uniform83], blank=model.NEG).item(), expected, rel_tol=1e-5)
    # Padding in a batch changes nothing: the mean of the two per-utterance losses.
    both = _ctc([uniform83, diagonal], blank=model.NEG).item()
    assert math.isclose(both, (expected + 0.0) / 2, rel_tol=1e-4, abs_tol=1e-5)


def _brute_force(logprob: np.ndarray) -> np.ndarray:
    T, N = logprob.shape
    best, best_path = -np.inf, None
    for cuts in itertools.combinations(range(1, T), N - 1):  # every split of T frames into N runs ≥ 1
        bounds = (0, *cuts, T)
        path = np.zeros((T, N), dtype=np.float32)
        for n in range(N):
            path[bounds[n]: bounds[n + 1], n] = 1
        score = (logprob * path).sum()
        if score > best:
            best, best_path = score, path
    return best_path


def test_mas_matches_brute_force():
    rng = np.random.default_rng(0)
    for T, N in [(1, 1), (5, 1), (4, 4), (7, 3), (9, 4), (10, 6)]:
        for _ in range(5):
            lp = np.log(rng.dirichlet(np.ones(N), size=T))
            assert np.array_equal(model.mas(lp), _brute_force(lp)), (T, N)
    with pytest.raises(ValueError):
        model.mas(np.zeros((2, 3)))


def test_mas_batch_durations_sum_to_mel_length():
    torch.manual_seed(0)
    text_lens, mel_lens = torch.tensor([3, 5]), torch.tensor([9, 12])
    logprob = torch.randn(2, 12, 5).log_softmax(-1)
    hard = model.mas_batch(logprob, text_lens, mel_lens)
    durations = hard.sum(1)
    assert torch.equal(durations.sum(1), mel_lens.float())
    assert (durations[0, :3] >= 1).all() and (durations[0, 3:] == 0).all() and (durations[1] >= 1).all()
    assert hard[0, 9:].sum() == 0  # nothing on padded frames
    idx = hard[1].argmax(1)
    assert idx[0] == 0 and idx[-1] == 4 and set(torch.diff(idx).tolist()) <= {0, 1}  # monotonic


def test_length_regulation():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    durations = torch.tensor([[1, 0, 2], [2, 2, 1]])
    y, lens = model.length_regulate(x, durations)
    assert y.shape == (2, 5, 2) and lens.tolist() == [3, 5]
    assert torch.equal(y[0, :3], x[0, [0, 2, 2]]) and (y[0, 3:] == 0).all()
    assert torch.equal(y[1], x[1, [0, 0, 1, 1, 2]])
    assert model.lengths_to_padding(lens).tolist() == [[False] * 3 + [True] * 2, [False] * 5]


def test_dropout_drops_p_keeps_the_mean_and_follows_the_seed():
    """The 16-bit-mask dropout: P(drop) = round(p·2¹⁶)/2¹⁶, E[out] = x, the gradient is the mask, the same
    seed gives the same mask, and outside training it is the identity."""
    x = torch.ones(400, 1000, requires_grad=True)
    torch.manual_seed(0)
    y = model.dropout(x, 0.1, True)
    dropped = float((y == 0).float().mean())
    assert abs(dropped - round(0.1 * 65536) / 65536) < 0.002 and abs(float(y.mean()) - 1) < 0.003
    assert torch.unique(y).tolist() == [0.0, pytest.approx(65536 / (65536 - round(0.1 * 65536)))]
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())
    torch.manual_seed(0)
    assert torch.equal(model.dropout(x, 0.1, True), y)
    assert model.dropout(x, 0.1, False) is x and model.dropout(x, 0.0, True) is x
    odd = model.dropout(torch.ones(3, 5, 7, dtype=torch.bfloat16), 0.5, True)  # numel not a multiple of 4
    assert odd.shape == (3, 5, 7) and odd.dtype == torch.bfloat16 and set(torch.unique(odd).tolist()) <= {0.0, 2.0}


def test_self_attention_is_multihead_attention_with_its_weights():
    """Outside training, `self_attention` computes what nn.MultiheadAttention does with the same weights
    and key padding (the checkpoint layout is the module's)."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True).eval()
    x = torch.randn(3, 9, 16)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[1, 6:], pad[2, 2:] = True, True
    expected, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
    assert torch.allclose(model.self_attention(mha, x, pad, training=False), expected, atol=1e-6)


def test_symbols_round_trip():
    s = model.Symbols(" abcdefghijklmnopqrstuvwxyz'.,")
    ids = s.encode("  It's   a Test, ok. ")
    assert min(ids) >= 1 and s.decode(ids) == "it's a test, ok."
    assert len(s) == 31  # 30 characters + padding
    with pytest.raises(ValueError, match="outside"):
        s.encode("numbers 42")
    with pytest.raises(ValueError):
        model.Symbols("aa")


def test_model_infer_lengths_match_durations():
    torch.manual_seed(0)
    m = model.AlignedFastSpeech(n_symbols=10, n_mels=80, dim=16, encoder_layers=1, decoder_layers=1, heads=2,
                                ffn_dim=32, kernel=3, dropout=0.0, duration_channels=16, attention_dim=16,
                                attention_temperature=0.0005, blank_logprob=-1.0).eval()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    mel, lens, durations = m.infer(tokens, torch.tensor([4, 2]))
    assert torch.equal(lens, durations.sum(1)) and (durations[0] >= 1).all() and (durations[1, 2:] == 0).all()
    assert mel.shape == (2, int(lens.max()), 80)
    # teacher forcing: durations from MAS sum to the mel lengths, losses are finite
    mels, mel_lens = torch.randn(2, 20, 80), torch.tensor([20, 11])
    prior = torch.full((2, 20, 4), model.NEG)
    prior[0] = model.beta_binomial_prior(20, 4).log()
    prior[1, :11, :2] = model.beta_binomial_prior(11, 2).log()
    out = m(tokens, torch.tensor([4, 2]), mels, mel_lens, prior, True)
    assert torch.equal(out["durations"].sum(1), mel_lens)
    assert all(torch.isfinite(out[k]) for k in ("mel_loss", "dur_loss", "len_loss", "align_loss", "bin_loss"))


def test_length_loss_fits_the_utterance_length():
    """len_loss compares Σ expm1(predicted log-durations) with the mel length: 0 when they agree, and
    its gradient raises a too-short prediction (the per-symbol log loss alone fits a geometric mean,
    which is short when durations vary)."""
    torch.manual_seed(0)
    m = model.AlignedFastSpeech(n_symbols=10, n_mels=80, dim=16, encoder_layers=1, decoder_layers=1, heads=2,
                                ffn_dim=32, kernel=3, dropout=0.0, duration_channels=16, attention_dim=16,
                                attention_temperature=0.005, blank_logprob=-1.0)
    tokens, text_lens = torch.tensor([[1, 2, 3, 4]]), torch.tensor([4])
    mels, mel_lens = torch.randn(1, 20, 80), torch.tensor([20])
    prior = model.beta_binomial_prior(20, 4).log()[None]
    out_layer = m.duration_predictor.out
    torch.nn.init.zeros_(out_layer.weight)
    with torch.no_grad():
        out_layer.bias.fill_(math.log1p(20 / 4))  # 5 frames per symbol: Σ = 20 = the mel length
    assert m(tokens, text_lens, mels, mel_lens, prior, False)["len_loss"].item() < 1e-10
    with torch.no_grad():
        out_layer.bias.fill_(math.log1p(2.0))  # 8 frames in all: too short
    len_loss = m(tokens, text_lens, mels, mel_lens, prior, False)["len_loss"]
    assert len_loss.item() == pytest.approx((math.log1p(8) - math.log1p(20)) ** 2, rel=1e-5)
    len_loss.backward()
    assert out_layer.bias.grad.item() < 0  # gradient descent lengthens it


def test_mcd_constants_and_dtw():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 80))
    assert audio.mcd_dtw(a, a) == 0.0
    assert audio.mcd_dtw(a, a + 3.0) < 1e-9  # a constant log offset lives in c0, which is excluded
    assert audio.mcd_dtw(a, rng.normal(size=(25, 80))) > 1.0
    assert audio.dtw_path(a[:3], a[:3]) == [(0, 0), (1, 1), (2, 2)]
    # log A(ω) = c0 + 2 Σ c_n cos(nω): a log amplitude 2·0.3·cos(3ω) (log power twice that) is c3 = 0.3
    m = np.arange(80)
    log_power = 2 * (1.0 + 2 * 0.3 * np.cos(np.pi * 3 * (m + 0.5) / 80))
    c = audio.mel_cepstra(np.tile(log_power, (4, 1)))
    assert c.shape == (4, 13) and np.allclose(c[:, 2], 0.3) and np.allclose(np.delete(c, 2, axis=1), 0, atol=1e-12)
    # so a difference of only Δc3 = 0.3 gives MCD = (10 / ln 10) · sqrt(2) · 0.3
    assert math.isclose(audio.mcd_dtw(np.tile(log_power, (4, 1)), np.full((4, 80), 2.0)),
                        10 / math.log(10) * math.sqrt(2) * 0.3, rel_tol=1e-9)


def test_png_writer(tmp_path):
    img = (np.arange(12, dtype=np.uint8) * 20).reshape(3, 4)
    audio.write_png(tmp_path / "x.png", img)
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(tmp_path / "x.png") as png:
        assert png.format == "PNG" and png.mode == "L" and np.array_equal(np.asarray(png), img)


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@slow
def test_smoke_then_synthesize_and_evaluate(tiny_corpus, tmp_path):
    """1 process with TensorBoard on: metrics, images/audio at validation, final/; synthesize.py
    makes a non-silent wav of plausible length; score.py scores the held-out sentences."""
    out = tmp_path / "run"
    run("tts", 1, args_for(tiny_corpus, out, "--max_steps", "8", "--eval_steps", "4", "--save_steps", "4",
                           "--report_to", "tensorboard", "--num_samples", "1", "--griffin_lim_iters", "4"))
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "mel_loss", "dur_loss", "align_loss", "bin_loss"))
    assert "eval_mel_loss" in rows[3] and "eval_align_loss" in rows[7]
    assert rows[-1]["mel_loss"] < rows[0]["mel_loss"]
    for f in ("model.safetensors", "config.yaml", "symbols.json"):
        assert (out / "final" / f).is_file()
    events = list((out / "tensorboard").rglob("events.out.tfevents.*"))
    blob = b"".join(p.read_bytes() for p in events)
    assert b"mel/0_synth" in blob and b"alignment/0_soft_hard" in blob and b"audio/0" in blob

    # --init_from's transfer: every weight but the symbol embeddings (matched by symbol) and the
    # feature statistics; a model of another shape is refused
    theirs = model.load_tts(out / "final")[0].state_dict()
    table = json.loads((out / "final" / "symbols.json").read_text())["symbols"]
    cfg = model.load_tts(out / "final")[1]
    new_table = table[5] + table[1] + "ж"  # two shared symbols in another order, one new
    fresh = model.build_model(type(cfg)(**{**vars(cfg), "symbols": new_table}))
    before = fresh.state_dict()
    line = model.transfer_from(fresh, new_table, out / "final")
    after = fresh.state_dict()
    assert "2 of 3 symbols shared" in line and "'ж'" in line
    assert torch.equal(after["embed.weight"][1], theirs["embed.weight"][6])
    assert torch.equal(after["embed.weight"][2], theirs["embed.weight"][2])
    assert torch.equal(after["embed.weight"][3], before["embed.weight"][3])  # the new symbol keeps its row
    assert torch.equal(after["feat_mean"], before["feat_mean"]) and not torch.equal(after["feat_mean"], theirs["feat_mean"])
    assert all(torch.equal(after[k], v) for k, v in theirs.items() if k not in ("embed.weight", "feat_mean", "feat_std"))
    wider = model.build_model(type(cfg)(**{**vars(cfg), "dim": 48}))
    with pytest.raises(ValueError, match="another shape"):
        model.transfer_from(wider, table, out / "final")

    text = "she could not believe the farmer"
    wav_path = tmp_path / "out.wav"
    python([RECIPE / "synthesize.py", "--checkpoint", out, "--text", text, "--output", wav_path,
            "--griffin_lim_iters", "4"]).check_returncode()
    wav, sr = sf.read(wav_path)
    assert sr == 22050 and wav.ndim == 1
    # plausible length: at least one 11.6 ms frame per character, at most 0.5 s per character
    assert len(text) * 256 <= len(wav) <= len(text) * sr * 0.5
    assert np.sqrt(np.mean(wav ** 2)) > 1e-3  # not silent
    lines = tmp_path / "lines.txt"
    lines.write_text("a radio wrote this\n\nthe pencil\n")
    python([RECIPE / "synthesize.py", "--checkpoint", out / "checkpoints" / "step_00000004", "--text_file", lines,
            "--output_dir", tmp_path / "wavs", "--griffin_lim_iters", "2"]).check_returncode()
    assert sorted(p.name for p in (tmp_path / "wavs").iterdir()) == ["0001.wav", "0002.wav"]

    python([RECIPE / "score.py", "--checkpoint", out, "--griffin_lim_iters", "2",
            "--output", tmp_path / "eval"]).check_returncode()
    summary = json.loads((tmp_path / "eval" / "test.json").read_text())
    assert summary["utterances"] == 2 and summary["durations_sum_ok"] == 2 and summary["monotonic_ok"] == 2
    assert math.isfinite(summary["mcd"]) and summary["mcd"] > 0
    assert list((tmp_path / "eval").glob("*.png"))
    scored = [json.loads(line) for line in (tmp_path / "eval" / "test.jsonl").read_text().splitlines()]
    shown, rows = assert_page_rows(tmp_path / "eval" / "test.html", scored, ["length_ratio", "mcd", "mcd_vocoded"],
                                   files=("synthesized", "recording", "mel", "alignment"))
    assert float(shown["mcd"]) == pytest.approx(summary["mcd"], rel=1e-3)
    assert all(r["judge"] is None for r in rows)  # no ASR judge asked for: no transcript shown

    # --split all --data_dir: every sentence of another folder of the voice, those the TTS trained on left out
    from tools.corpus import heldout_ljspeech
    new = heldout_ljspeech(tmp_path / "heldout", 2)  # two sentences no profile of the corpus speaks
    first = (tiny_corpus / "ljspeech" / "metadata.csv").read_text().splitlines()[0]  # a training utterance
    shutil.copy(tiny_corpus / "ljspeech" / "wavs" / f"{first.split('|')[0]}.wav", new / "wavs")
    (new / "metadata.csv").write_text((new / "metadata.csv").read_text() + first.upper() + "\n")  # case aside
    proc = python([RECIPE / "score.py", "--checkpoint", out, "--griffin_lim_iters", "2", "--split", "all",
                   "--data_dir", new, "--output", tmp_path / "eval_all"])
    assert proc.returncode == 0, proc.stderr
    assert f"trained on the sentences of 1 of the 3 utterances of {new} ({first.split('|')[0]})" in proc.stdout
    assert [json.loads(line)["id"] for line in (tmp_path / "eval_all" / "all.jsonl").read_text().splitlines()] == [
        "HO-0001", "HO-0002"]
    score = recipe_modules("tts", "score").score
    trained = [m.split("|") for m in (tiny_corpus / "ljspeech" / "metadata.csv").read_text().splitlines()]
    config = model.load_tts(out / "final")[1]
    assert score.tts_heard(out / "final", config, {i: t for i, t, _ in trained}) == [i for i, *_ in trained[:-4]]
    shutil.rmtree(out / "data")  # which sentences it trained on cannot be checked: refused, never guessed
    with pytest.raises(SystemExit):
        score.tts_heard(out / "final", config, {"x": "a radio"})


@slow
def test_score_leaves_out_the_sentences_its_asr_judge_trained_on(tiny_corpus, tmp_path, reference):
    """score.py --asr_checkpoint: a held-out sentence the judge trained on (its run's training
    manifest; the same words in other case and punctuation) is named and left out of the ASR scores
    (of the synthesized sentences and, --asr_vocoder_floor, of the vocoder on the recordings' mel);
    a judge whose training sentences cannot be read is refused in one line, before any synthesis,
    unless --asr_judge_check false."""
    tts = reference("tts", 1, lambda o: args_for(tiny_corpus, o, "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0"))
    judge = short_run(reference, tiny_corpus, tmp_path / "judge")  # an ASR run; only its manifests matter here
    [manifest] = judge.glob("data/train-*/manifest.jsonl")
    kept = manifest.read_text()
    shutil.move(manifest.parent, tmp_path / "kept")
    score = lambda *extra: python([RECIPE / "score.py", "--checkpoint", tts, "--griffin_lim_iters", "2",  # noqa: E731
                                   "--asr_checkpoint", judge, "--asr_recordings", "false", "--output", tmp_path / "eval", *extra])
    refused = score()
    assert refused.returncode == 2 and len([x for x in refused.stderr.splitlines() if x.startswith("error:")]) == 1
    assert "which sentences this judge trained on cannot be checked" in refused.stderr and "--asr_judge_check false" in refused.stderr
    assert not (tmp_path / "eval" / "wavs").exists()  # refused before any synthesis

    score("--asr_judge_check", "false").check_returncode()
    summary = json.loads((tmp_path / "eval" / "test.json").read_text())
    assert summary["asr_judge"] == {"checked": False, "heard": [], "scored": 2} and 0 <= summary["asr"]["cer"]
    first, second = [json.loads(line) for line in (tmp_path / "eval" / "test.jsonl").read_text().splitlines()]
    planted = {"id": "9-9-9999", "text": first["text"].upper() + "!"}  # the judge heard this sentence
    shutil.move(tmp_path / "kept", manifest.parent)
    manifest.write_text(kept + json.dumps({**json.loads(kept.splitlines()[0]), **planted}) + "\n")
    (manifest.parent / "COMPLETE").unlink()
    seal_export(manifest.parent)  # planted as if the judge's data check had written it (an edit is refused)
    proc = score("--asr_vocoder_floor", "true")
    assert proc.returncode == 0, proc.stderr
    assert f"the ASR judge trained on the sentences of 1 of the 2 test utterances ({first['id']})" in proc.stdout
    summary = json.loads((tmp_path / "eval" / "test.json").read_text())
    assert summary["asr_judge"] == {"checked": True, "heard": [first["id"]], "scored": 1}
    for part in ("", "vocoder_floor"):  # the synthesized sentence, and the vocoder on its recording's mel
        trans = next((tmp_path / "eval" / part / "librispeech" / "test").rglob("*.trans.txt")).read_text()
        assert trans.count("\n") == 1 and second["text"].upper() in trans  # the ASR read only the unheard one
    assert 0 <= summary["asr_vocoder_floor"]["cer"] and "asr_recordings" not in summary
    rows = {r["id"]: r for r in read_page(tmp_path / "eval" / "test.html")[1]["rows"]}  # what the judge heard
    [judged] = [json.loads(line) for line in (tmp_path / "eval" / "asr" / "test-greedy.jsonl").read_text().splitlines()]
    assert rows[first["id"]]["judge"] is None and rows[second["id"]]["judge_cer"] == pytest.approx(
        jiwer.cer(judged["ref"], judged["hyp"]))


def test_score_refuses_a_judge_whose_manifests_changed_or_are_not_rows(tmp_path, capsys):
    """The judge's training manifests (an ASR run's <run>/data/train-*/) are read checked: edited since
    their seal, emptied, or holding a line that is not a row with text, the score stops in one line
    naming the file and the way out, not a traceback, and never judges on sentences it cannot see."""
    score = recipe_modules("tts", "score").score
    final = tmp_path / "judge" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"weights")
    seal_export(final)
    data = tmp_path / "judge" / "data" / "train-0123456789abcdef"
    data.mkdir(parents=True)
    (data / "manifest.jsonl").write_text('{"id": "1", "text": "A radio."}\n')
    (data / ".complete").write_text("{}")
    seal_export(data)
    assert score.judge_heard(str(tmp_path / "judge"), {"x": "a RADIO", "y": "a pencil"}) == ["x"]
    for damage, message in (("", "does not match its COMPLETE marker (manifest.jsonl has 0 bytes"),
                            ('{"id": "1", "text": null}\n', "its 'text' is null, not text"),
                            ("\n", "manifest.jsonl:1: not a JSON object")):
        (data / "manifest.jsonl").write_text(damage)
        if damage != "":
            (data / "COMPLETE").unlink(missing_ok=True)  # a folder from before seals: its lines are checked
        with pytest.raises(SystemExit) as e:
            score.judge_heard(str(tmp_path / "judge"), {"x": "a radio"})
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
        assert err.startswith(f"error: --asr_checkpoint {tmp_path / 'judge'}: which sentences this judge trained on "
                              f"cannot be read: ") and err.rstrip().endswith("or pass --asr_judge_check false")


@slow
def test_smoke_two_processes(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    run("tts", 2, args_for(tiny_corpus, out, "--max_steps", "4", "--eval_steps", "2", "--save_steps", "2"))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.accelerate_launch
@slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_interrupted_equals_continuous(tiny_corpus, tmp_path, nproc):
    """SIGKILL inside epoch 0 (1 process: and inside epoch 1), re-launch: same weights and losses.
    The binarization loss switches on at step 3, the validation pass runs on the way; the weight
    average (--ema_decay) is resumed with the run, and final/ holds it."""
    e0, e1 = epoch_lengths(read_ljspeech(tiny_corpus / "ljspeech")["duration"][:-4], 16.0, nproc, 2)  # train = all but 4
    assert e0 >= 3 and e1 >= 3
    kills = [2, e0 + 1] if nproc == 1 else [2]
    max_steps = e0 + 2
    extra = ["--max_steps", str(max_steps), "--save_steps", "1", "--save_total_limit", "3", "--eval_steps", "3",
             "--ema_decay", "0.99"]

    cont = tmp_path / "continuous"
    run("tts", nproc, args_for(tiny_corpus, cont, *extra), launcher=False)  # the reference: forked (the guarantee is the cut run's)
    cut = tmp_path / "interrupted"
    for i, k in enumerate(kills):  # the first kill in 1 process (harness.KILL_LEG); the middle leg forked
        run("tts", nproc, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k, launcher=i == 0 and nproc == 1)
    run("tts", nproc, args_for(tiny_corpus, cut, *extra))

    resumes = resumed_positions(tmp_path / "interrupted.log")
    assert len(resumes) == len(kills)
    assert resumes[0][1] == 0 and resumes[0][2] > 0, resumes  # the first cut was inside epoch 0
    if nproc == 1:
        assert resumes[1][1] == 1 and resumes[1][2] > 0, resumes  # the second inside epoch 1
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    assert [r["step"] for r in metrics(cut)] == list(range(1, max_steps + 1))
    # final/ (and the tools reading the last checkpoint: load_tts with checkpoint_weights) has the
    # average, not the trained weights the checkpoint resumes from
    last = cut / "checkpoints" / f"step_{max_steps:08d}"
    final = model.load_tts(cut / "final")[0].state_dict()
    averaged = model.load_tts(last, weights=checkpoint_weights(last))[0].state_dict()
    trained = load_file(last / "model.safetensors")
    assert final.keys() == averaged.keys() and all(torch.equal(final[k], averaged[k]) for k in final)
    assert not torch.equal(averaged["embed.weight"], trained["embed.weight"])
    assert torch.equal(averaged["feat_mean"], trained["feat_mean"])  # buffers are the model's own


@slow
def test_transfer_script_trains_the_base_once_then_the_voice_from_it(tiny_corpus, tmp_path):
    """recipes/tts/transfer.sh: stage 1 (the base voice, en-us phonemes), stage 2 (the voice, another
    language's phonemes, --init_from the base); run again, it skips stage 1 and stage 2's finished run
    is left as it was. Tiny sizes through BASE_ARGS and the voice's arguments; `accelerate launch`
    stands in as a forked `python` (harness.accelerate_stand_in; the script's launcher is not what is tested here)."""
    from tests.harness.harness import accelerate_stand_in, cpu_tokens, on_cores

    shim = accelerate_stand_in(tmp_path)
    base, out, voice = tmp_path / "base", tmp_path / "voice", tiny_corpus / "ljspeech"
    env = {**os.environ, "ACCELERATE": str(shim), "BASE": str(base), "OUT": str(out), "MAX_STEPS": "2",
           "BASE_ARGS": " ".join([*TINY_MODEL, "--data_dir", str(voice), "--max_steps", "2"]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def transfer():
        with cpu_tokens(1) as cpus:
            return subprocess.run(["bash", str(RECIPE / "transfer.sh"), str(voice), "es", *TINY_MODEL, "--save_steps", "2"],
                                  env=env, capture_output=True, text=True, timeout=600, preexec_fn=on_cores(cpus))

    first = transfer()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "1/2 the built-in voice" in first.stdout and "2/2" in first.stdout
    assert (base / "final" / "COMPLETE").is_file() and (out / "final" / "COMPLETE").is_file()
    assert re.search(r"initialized from \S+: \d+ of \d+ symbols shared", first.stderr)
    saved = yaml.safe_load((out / "final" / "config.yaml").read_text())
    assert (saved["text_frontend"], saved["phonemizer_language"], saved["init_from"]) == ("phonemes", "es", str(base))
    weights = (out / "final" / "model.safetensors").read_bytes()

    again = transfer()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "1/2" not in again.stdout and "2/2" in again.stdout
    assert (out / "final" / "model.safetensors").read_bytes() == weights


def _base_yaml(tmp_path: Path, steps: int) -> Path:
    """A built-in base of the tiny corpus (its 24 utterances: 2 validation, 2 test), `steps` steps."""
    path = tmp_path / "base.yaml"
    path.write_text(f"num_valid: 2\nnum_test: 2\nmax_steps: {steps}\nwarmup_steps: 5\nmax_batch_seconds: 16\n"
                    "stats_utterances: 20\nsave_steps: 2\nlogging_steps: 1\n")
    return path


def _builtin_args(tiny_corpus: Path, out: Path, base_yaml: Path, *extra: str, cache: Path | None = None) -> list[str]:
    return last_flag_wins([*args_for(tiny_corpus, out, "--max_steps", "2", *extra), "--init_from", "builtin",
                           "--builtin_corpus", "tiny", "--base_config", str(base_yaml),
                           "--data_cache_dir", str(cache or tiny_corpus.parent)])


@slow
def test_init_from_builtin_trains_the_base_once_per_machine(tiny_corpus, tmp_path):
    """--init_from builtin: the first voice trains the base (a child run on the built-in corpus with
    the voice's model shape, into the corpus cache) and starts from it; a second voice starts from the
    same base without training it; the built-in voice itself trains from scratch; a base whose
    training fails is one line naming its command."""
    base_yaml = _base_yaml(tmp_path, 3)
    first = run("tts", 1, _builtin_args(tiny_corpus, tmp_path / "voice1", base_yaml))
    assert first.count("training it once for this machine") == 1
    base = re.search(r"initialized from (\S+)/final: 38 of 38 symbols shared", first).group(1)
    assert Path(base).parent == tiny_corpus.parent and Path(base).name.startswith("tts_base-")
    trained = yaml.safe_load((Path(base) / "final" / "config.yaml").read_text())
    assert (trained["data_dir"], trained["init_from"], trained["dim"], trained["max_steps"]) == (None, None, 32, 3)
    saved = yaml.safe_load((tmp_path / "voice1" / "final" / "config.yaml").read_text())
    assert saved["init_from"] == "builtin"

    second = run("tts", 1, _builtin_args(tiny_corpus, tmp_path / "voice2", base_yaml))
    assert "training it once" not in second and f"initialized from {base}/final" in second
    wider = run("tts", 1, _builtin_args(tiny_corpus, tmp_path / "voice3", base_yaml, "--dim", "48"))
    assert "training it once" in wider and f"initialized from {base}/final" not in wider  # another shape, another base

    # config.yaml as it is on the built-in voice: phonemes, English; auto means from scratch
    itself = run("tts", 1, [*TINY_MODEL, "--max_steps", "2", "--output_dir", str(tmp_path / "builtin"),
                            "--builtin_corpus", "tiny", "--data_cache_dir", str(tiny_corpus.parent)])
    assert "this run trains on the built-in corpus: from scratch (it is the base of other voices)" in itself
    assert "initialized from" not in itself
    saved = yaml.safe_load((tmp_path / "builtin" / "final" / "config.yaml").read_text())
    assert (saved["text_frontend"], saved["phonemizer_language"], saved["init_from"]) == ("phonemes", "en-us", "auto")
    # a voice of one's own in phonemes: its language read off its transcripts (English here), or refused
    phonemes = ["--text_frontend", "phonemes", "--symbols", "auto", "--phonemizer_language", "none"]
    guessed = run("tts", 1, _builtin_args(tiny_corpus, tmp_path / "v5", base_yaml, *phonemes))
    assert "--phonemizer_language en-us: read off the training transcripts (function words: " in guessed
    assert yaml.safe_load((tmp_path / "v5" / "final" / "config.yaml").read_text())["phonemizer_language"] == "en-us"
    unclear = tmp_path / "unclear"
    shutil.copytree(tiny_corpus / "ljspeech", unclear)
    rows = (unclear / "metadata.csv").read_text().splitlines()
    (unclear / "metadata.csv").write_text("".join(f"{r.split('|')[0]}|Zq xv brr|Zq xv brr\n" for r in rows))
    refused = run("tts", 1, [*_builtin_args(tiny_corpus, tmp_path / "v6", base_yaml, *phonemes), "--data_dir", str(unclear)],
                  expect_rc=1)
    assert "error: --phonemizer_language: the training transcripts do not say which language your voice speaks" in refused
    assert "training it once" not in refused  # refused before any base is made

    broken = tmp_path / "broken.yaml"
    broken.write_text(base_yaml.read_text().replace("num_valid: 2", "num_valid: 30"))
    failed = run("tts", 1, _builtin_args(tiny_corpus, tmp_path / "voice4", broken), expect_rc=1)
    assert "leave none for training" in failed
    assert re.search(r"error: the built-in base's training failed \(exit 2\); its command, to run and read by hand: "
                     r"\S+python\S* \S+recipes/tts/train.py --config " + re.escape(str(broken)), failed)


@slow
def test_a_stopped_voice_run_stops_its_base_and_the_relaunch_resumes_it(tiny_corpus, tmp_path):
    """While the base trains: SIGKILL to the voice's process — the base's child run notices (it watches
    its parent: common/training/launcher.py), saves and stops within seconds; then, re-launched, SIGTERM to
    the voice's process — it asks the child to stop the same way and waits for its save. The same command
    re-launched once more resumes the base from its last checkpoint and trains the voice from it."""
    import psutil

    from tests.harness.harness import base_env, cpu_tokens, fork, kill_tree, on_cores

    cache = tmp_path / "cache"  # this test's own: the base it waits for is the only one
    cache.mkdir()
    (cache / tiny_corpus.name).symlink_to(tiny_corpus)
    args = _builtin_args(tiny_corpus, tmp_path / "voice", _base_yaml(tmp_path, 30), cache=cache)
    log = tmp_path / "voice.log"

    def newest() -> int:  # the base's newest checkpoint step (0: none)
        return max([int(p.name[5:]) for p in cache.glob("tts_base-*.run/checkpoints/step_*")], default=0)

    def stop_during_base(stop) -> tuple[int, int | None]:
        """Launch, wait until the base has saved a checkpoint in this launch, `stop(voice process)`; → its
        pid and exit code."""
        with cpu_tokens(1) as cpus, open(log, "a") as out:
            before = newest()
            argv = [str(RECIPE / "train.py"), *args]  # `python train.py`, forked (its imports spared) unless HARNESS_FORK=0
            proc = fork(argv, 1, base_env(None), out, cpus=cpus) or subprocess.Popen(
                [sys.executable, *argv], env=base_env(None), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=on_cores(cpus))
            child = None
            try:
                deadline = time.monotonic() + 300
                while newest() <= before or not psutil.Process(proc.pid).children():
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.02)
                child = psutil.Process(proc.pid).children()[0]
                stop(proc)
                returncode = proc.wait(60)
                child.wait(30)  # gone (psutil.TimeoutExpired otherwise)
                return proc.pid, returncode
            finally:  # nothing outlives a failed test
                kill_tree(proc)
                if child is not None and child.is_running():
                    child.kill()

    pid, _ = stop_during_base(lambda proc: proc.kill())
    assert f"the launcher (pid {pid}) ended: saving a checkpoint at the next step boundary" in log.read_text()
    first_stop = newest()
    _, returncode = stop_during_base(lambda proc: proc.terminate())
    assert returncode == 75 and "resumed from" in log.read_text()
    assert len(re.findall(r"preempted at step \d+: checkpoint saved", log.read_text())) == 2  # the child, twice
    last = newest()
    assert first_stop < last < 30
    again = run("tts", 1, args)
    assert f"resumed from {next(cache.glob('tts_base-*.run'))}/checkpoints/step_{last:08d}" in again
    assert "initialized from" in again and (tmp_path / "voice" / "final" / "COMPLETE").is_file()
