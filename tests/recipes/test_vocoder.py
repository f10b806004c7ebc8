"""Vocoder (Vocos-style generator, multi-period + multi-resolution STFT discriminators, two AdamW, two
schedules, generator-only steps before --gan_start_steps, accumulation): the mel is the TTS recipe's,
and end to end through `accelerate launch`: killed with SIGKILL and re-launched ends bit-identical to a
run never stopped in 1 and 2 processes, continues on fewer processes, a kill during the export leaves
no final/, preemption saves and resumes exactly; synthesize.py --vocoder on a tiny TTS + this vocoder,
evaluate.py on 2 utterances, and the refusal of a vocoder trained on another mel."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file

from common.config import load_config, parse_config, save_config
from common.training.checkpoint import model_weights_files
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import (ROOT, SUPPORT, assert_same_losses, assert_same_weights, checkpoint_exists, kill_tree,
                                   last_flag_wins, metrics, python, resumed_positions, run, worker)
from tests.recipes.test_tts import args_for as tts_args_for
from tests.tools.test_report import assert_page_rows

slow = pytest.mark.slow

# Tiny: a 1-block generator and 2 + 2 sub-discriminators of 4 channels on 12-frame segments (the envelope loss needs 8 of its frames: 11).
# From scratch: config.yaml's built-in base for a voice of one's own is tested on its own.
TINY = ["--dim", "16", "--hidden_dim", "32", "--layers", "1", "--periods", "2,3", "--period_channels", "4,4",
        "--resolutions", "256,512", "--resolution_channels", "4", "--segment_frames", "12", "--num_valid", "2",
        "--num_test", "2", "--max_batch_seconds", "8", "--logging_steps", "1", "--eval_steps", "4",
        "--report_to", "none", "--gan_start_steps", "2", "--init_from", "none"]
STEPS = ["--max_steps", "8", "--save_steps", "1", "--save_total_limit", "3", "--gradient_accumulation_steps", "2"]

vocoder = recipe_modules("vocoder", "model", "data", "evaluate")


def args_for(corpus: Path, out: Path, *extra: str) -> list[str]:
    return last_flag_wins(["--data_dir", str(corpus / "ljspeech"), "--output_dir", str(out), *TINY, *extra])


# ---------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------


def test_the_generator_gives_the_samples_whose_mel_has_its_frames():
    from common.model.features import mel_frontend

    cfg = type("C", (), dict(n_mels=80, win_length=1024, hop_length=256, dim=16, hidden_dim=32, layers=1, sample_rate=22050))
    frontend = mel_frontend(22050, 80, 1024, 256)
    mel = frontend(torch.randn(8 * 256) * 0.1)  # (9, 80): centred frames
    wav = vocoder.model.build_generator(cfg)(mel[None])[0]
    assert wav.shape == (8 * 256,) and frontend(wav).shape == mel.shape


def test_phase_refinement_gives_a_signal_whose_mel_is_the_input_mel():
    """`refine` scales its magnitude (the head's and the output signal's, `REFINE_HEAD_WEIGHT`) to the mel's band
    energies and makes the spectrum consistent (Griffin-Lim from the output signal's phases): even an untrained
    generator's output then re-analyses to the mel it was given; the gain alone does most of it, and the
    iterations get closer (the overlap-add of inconsistent frames is what they remove)."""
    from common.model.features import mel_frontend

    torch.manual_seed(0)
    cfg = type("C", (), dict(n_mels=80, win_length=1024, hop_length=256, dim=16, hidden_dim=32, layers=1,
                             sample_rate=22050, magnitude_prior=True, refine_iters=32))
    frontend = mel_frontend(22050, 80, 1024, 256)
    t = torch.arange(11025) / 22050
    phase = 2 * torch.pi * torch.cumsum(150 + 50 * t, 0) / 22050  # a gliding 150-200 Hz voice, 14 harmonics
    voice = sum(torch.sin(k * phase) / k for k in range(1, 15)) * 0.1 * (1 + torch.sin(2 * torch.pi * 3 * t))
    mel = frontend(voice)
    generator = vocoder.model.build_generator(cfg).eval()
    loud = mel > mel.max() - 8  # within 8 nats of the loudest bin: where the voice is

    def error(iters):  # mean |log-mel difference| (nats) of the output, re-analysed, where the voice is
        return float((frontend(vocoder.model.vocode(generator, mel, iters)) - mel)[loud].abs().mean())

    raw, gained, refined = error(0), float((frontend(generator.refine(mel[None], 0)[0]) - mel)[loud].abs().mean()), error(None)
    assert gained < 0.4 * raw and refined < 0.8 * gained and refined < 0.5, (raw, gained, refined)  # None: its own 32
    assert torch.equal(vocoder.model.vocode(generator, mel, 0), generator(mel[None])[0].clamp(-1, 1))  # 0: as trained
    for frames in (1, 3):  # under one window's padding: one line saying so, not an error from inside torch
        with pytest.raises(ValueError, match=f"a mel of {frames} frames is too short to vocode: at least 4"):
            vocoder.model.vocode(generator, mel[:frames])
    assert vocoder.model.vocode(generator, mel[:4]).shape == (3 * 256,)


def test_the_segment_collator_cuts_the_same_segments_for_the_same_position():
    cfg = type("C", (), dict(seed=1, segment_frames=4, hop_length=256, sample_rate=22050, n_mels=80, win_length=1024))
    items = [("a", torch.randn(22050)), ("b", torch.randn(300))]  # b: shorter than a segment (zero-padded)
    c = vocoder.data.SegmentCollator(cfg)
    first = c(items)
    assert first["wavs"].shape == (2, 1024) and first["mels"].shape == (2, 5, 80)
    assert torch.equal(first["wavs"], c(items)["wavs"])  # a pure function of (seed, epoch, id)
    c.set_epoch(1)
    assert not torch.equal(first["wavs"][0], c(items)["wavs"][0])  # another epoch, another segment
    assert torch.equal(first["wavs"][1, :300], items[1][1]) and not first["wavs"][1, 300:].any()


def test_mel_mismatch_names_what_differs():
    a = type("A", (), dict(sample_rate=22050, n_mels=80, win_length=1024, hop_length=256))
    b = type("B", (), dict(sample_rate=22050, n_mels=80, win_length=1024, hop_length=128))
    assert vocoder.model.mel_mismatch(a, a) is None
    assert vocoder.model.mel_mismatch(a, b) == "hop_length 256 vs 128"


def test_stoi_per_band_averages_to_pystoi_and_shows_where_a_band_is_lost():
    import numpy as np
    from pystoi import stoi

    rng = np.random.default_rng(0)
    t = np.arange(2 * 22050) / 22050
    # 2 s of noise under a 4 Hz syllabic envelope (speech-like modulations in every band)
    ref = rng.standard_normal(len(t)) * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))
    spectrum = np.fft.rfft(ref + 0.3 * rng.standard_normal(len(t)))
    low = np.fft.rfftfreq(len(t), 1 / 22050) < 400  # the output loses the envelope below 400 Hz:
    spectrum[low] = np.fft.rfft(rng.standard_normal(len(t)))[low]  # unmodulated noise there instead
    out = np.fft.irfft(spectrum, len(t))
    bands = vocoder.evaluate.stoi_per_band(ref, out, 22050)
    assert bands.shape == (15,) and abs(bands.mean() - stoi(ref, out, 22050)) < 1e-12
    assert bands[:3].max() < bands[6:].min()  # 150, 189, 238 Hz below every band from 600 Hz up
    assert vocoder.evaluate.stoi_per_band(ref[:3000], out[:3000], 22050) is None  # under 30 frames


def test_mel_resolutions_average_more_mel_terms_and_refuse_a_window_longer_than_a_segment():
    train = recipe_modules("vocoder", "train").train
    cfg = train.Config(mel_resolutions=[512, 2048])
    real, fake = torch.randn(2, 8192) * 0.1, torch.randn(2, 8192) * 0.1
    main = vocoder.data.loss_frontend(cfg, "cpu")
    extra = vocoder.data.extra_mel_frontends(cfg, "cpu")
    assert [(f.mel.n_fft, f.mel.hop_length, f.mel.n_mels) for f in extra] == [(512, 128, 40), (2048, 512, 160)]
    _, stats = vocoder.model.generator_loss(None, main, real, fake, main(real), cfg, adversarial=False, extra_frontends=extra)
    parts = [vocoder.model.mel_l1(main, fake, main(real))] + [vocoder.model.mel_l1(f, fake, f(real)) for f in extra]
    assert torch.allclose(stats["mel_loss"], sum(parts) / 3)
    with pytest.raises(ValueError, match="--mel_resolutions: 16384 is longer than a training segment"):
        train.Config(mel_resolutions=[16384]).validate()


def test_the_magnitude_prior_is_griffin_lims_starting_magnitude_and_the_head_corrects_it():
    from common.model.features import mel_frontend
    from common.model.vocoding import GriffinLim

    frontend = mel_frontend(22050, 80, 1024, 256)
    model = vocoder.model
    # the model file's own filterbank (it imports nothing of this repository) is the frontend's mel
    assert torch.allclose(model.htk_mel_filterbank(513, 80, 22050), frontend.mel.mel_scale.fb, atol=1e-5)
    cfg = type("C", (), dict(n_mels=80, win_length=1024, hop_length=256, dim=16, hidden_dim=32, layers=1,
                             sample_rate=22050, magnitude_prior=True))
    generator = model.build_generator(cfg)
    assert "mel_inverse" not in generator.state_dict()  # a formula, not weights: exports keep their keys
    mel = frontend(torch.randn(8 * 256) * 0.1)  # (9, 80)
    least_squares = GriffinLim(frontend).inverse_mel(torch.exp(mel).T)  # (513, 9), ≥ 0: what Griffin-Lim starts from
    ours = (torch.exp(mel) @ generator.mel_inverse.T).T.clamp_min(0)
    assert torch.allclose(ours, least_squares, rtol=1e-3, atol=1e-3 * float(least_squares.max()))
    # a head that predicts nothing gives that magnitude (floored where the least squares go under 1e-6)
    torch.nn.init.zeros_(generator.head.weight), torch.nn.init.zeros_(generator.head.bias)
    assert torch.allclose(generator.spectrum(mel[None])[0].abs(), ours.clamp_min(1e-6).sqrt(), rtol=1e-4)
    generator.mel_inverse = None  # the same weights without the prior: magnitude 1, phase 0 everywhere
    assert torch.equal(generator.spectrum(mel[None])[0], torch.ones(513, 9, dtype=torch.complex64))


def test_spectral_convergence_is_the_relative_linear_magnitude_error_and_refuses_a_short_segment():
    train = recipe_modules("vocoder", "train").train
    real = torch.randn(2, 8192) * 0.1
    sc = functools.partial(vocoder.model.spectral_convergence, resolutions=vocoder.model.SC_RESOLUTIONS)
    assert sc(real, real) == 0
    assert torch.isclose(sc(real, torch.zeros_like(real)), torch.tensor(1.0))
    assert torch.isclose(sc(real, 1.5 * real), torch.tensor(0.5))  # |S| scales: ‖0.5 S‖ / ‖S‖
    cfg = train.Config(sc_loss_weight=10.0)
    main = vocoder.data.loss_frontend(cfg, "cpu")
    fake = torch.randn(2, 8192) * 0.1
    loss, stats = vocoder.model.generator_loss(None, main, real, fake, main(real), cfg, adversarial=False)
    assert torch.isclose(loss, 45.0 * stats["mel_loss"] + 10.0 * sc(real, fake))
    assert "sc_loss" not in vocoder.model.generator_loss(None, main, real, fake, main(real), train.Config(), False)[1]
    with pytest.raises(ValueError, match="--sc_loss_weight: its 2048-sample STFT is longer than a training segment"):
        train.Config(sc_loss_weight=1.0, segment_frames=4, resolutions=[512]).validate()


def test_phase_loss_is_zero_for_the_recordings_phase_up_to_whole_turns_and_weights_by_its_magnitude():
    import math

    train = recipe_modules("vocoder", "train").train
    real = torch.randn(2, 8192) * 0.1
    spec = torch.stft(real, 1024, 256, window=torch.hann_window(1024), return_complex=True)  # (2, 513, 33)
    phase = spec.angle()
    assert vocoder.model.phase_loss(real, phase, 1024, 256) < 1e-5
    turns = 2 * math.pi * torch.randint(-3, 4, phase.shape)  # whole turns per bin: the same phase
    assert vocoder.model.phase_loss(real, phase + turns, 1024, 256) < 1e-4
    # a constant offset: only the phase's own value is off (its differences along time and frequency
    # are not), by 0.5 rad weighted by magnitude / mean magnitude, whose mean is 1
    assert torch.isclose(vocoder.model.phase_loss(real, phase + 0.5, 1024, 256), torch.tensor(0.5), atol=1e-4)
    assert torch.allclose(vocoder.model.anti_wrapped(torch.tensor([0.1, -0.1, 2 * math.pi - 0.1, math.pi])),
                          torch.tensor([0.1, 0.1, 0.1, math.pi]), atol=1e-6)
    cfg = train.Config(phase_loss_weight=3.0)
    main = vocoder.data.loss_frontend(cfg, "cpu")
    noisy = phase + torch.randn_like(phase)
    loss, stats = vocoder.model.generator_loss(None, main, real, real, main(real), cfg, adversarial=False, phase=noisy)
    assert torch.isclose(loss, 45.0 * stats["mel_loss"] + 3.0 * vocoder.model.phase_loss(real, noisy, 1024, 256))


def test_envelope_loss_is_one_minus_stoi_of_each_segment_and_refuses_a_segment_of_under_8_frames():
    import numpy as np
    from pystoi import stoi

    train = recipe_modules("vocoder", "train").train
    rng = np.random.default_rng(0)
    t = np.arange(4 * 8192) / 22050
    ref = rng.standard_normal(len(t)) * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))  # a 4 Hz syllabic envelope
    real = torch.tensor(ref, dtype=torch.float32).reshape(4, 8192)  # four 0.37 s segments
    loss = lambda fake: vocoder.model.envelope_loss(real, fake, 22050)  # noqa: E731
    assert loss(real) < 1e-4 and loss(3 * real) < 1e-4  # the level is not STOI's business
    scores = []
    for noise in (0.5, 1.0, 2.0):  # within 0.03 of pystoi's STOI of the whole signal, its order kept
        out = ref + noise * rng.standard_normal(len(t))
        scores.append(1 - float(loss(torch.tensor(out, dtype=torch.float32).reshape(4, 8192))))
        assert abs(scores[-1] - stoi(ref, out, 22050)) < 0.03, (noise, scores[-1])
    assert scores == sorted(scores, reverse=True)
    fake = (real + torch.randn_like(real)).requires_grad_()
    loss(fake).backward()
    assert torch.isfinite(fake.grad).all() and fake.grad.abs().sum() > 0
    cfg = train.Config(envelope_loss_weight=20.0)
    main = vocoder.data.loss_frontend(cfg, "cpu")
    total, stats = vocoder.model.generator_loss(None, main, real, fake.detach(), main(real), cfg, adversarial=False)
    assert torch.isclose(total, 45.0 * stats["mel_loss"] + 20.0 * stats["envelope_loss"])
    assert "envelope_loss" not in vocoder.model.generator_loss(None, main, real, real, main(real), train.Config(), False)[1]
    with pytest.raises(ValueError, match="--envelope_loss_weight: a training segment .2048 samples. holds fewer than its 8"):
        train.Config(envelope_loss_weight=1.0, segment_frames=8, resolutions=[512]).validate()


def _tts_run(folder: Path, corpus: Path, **changes) -> Path:
    """A TTS run's output_dir as --tts_run reads it: the config.yaml its training writes (the TTS recipe's
    Config) for the tiny corpus, 2 validation and 2 test utterances, `changes` made."""
    tts_config = recipe_modules("tts", "train").train.Config
    folder.mkdir(parents=True)
    save_config(tts_config(data_dir=str(corpus / "ljspeech"), num_valid=2, num_test=2, **changes), folder / "config.yaml")
    return folder


def test_tts_run_takes_the_runs_data_and_split_and_refuses_another_mel_or_split(tiny_corpus, tmp_path, capsys):
    """--tts_run: the data, held-out split and data-check rules of the TTS run's config.yaml, output_dir
    <run>/vocoder unless given; one line refuses a data setting given otherwise, another mel, and a folder
    that is not a TTS run's output_dir."""
    train = recipe_modules("vocoder", "train").train

    def parse(*argv):
        return parse_config(train.Config, [str(a) for a in argv], default_yaml=ROOT / "recipes" / "vocoder" / "config.yaml")

    def refused(*argv) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            parse(*argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        return err

    tts = _tts_run(tmp_path / "tts", tiny_corpus, max_seconds=25.0, builtin_corpus="tiny")
    cfg = parse("--tts_run", tts)
    assert (cfg.data_dir, cfg.num_valid, cfg.num_test, cfg.max_seconds) == (str(tiny_corpus / "ljspeech"), 2, 2, 25.0)
    assert cfg.output_dir == str(tts / "vocoder") and cfg.builtin_corpus == "default"  # (its data is a folder)
    given = parse("--tts_run", tts, "--num_test", "2", "--output_dir", tmp_path / "mine")  # the run's value; output_dir wins
    assert (given.num_test, given.output_dir) == (2, str(tmp_path / "mine"))
    assert refused("--tts_run", tts, "--num_test", "20") == (
        f"error: --num_test 20: this vocoder reads it from --tts_run {tts} (num_test 2), whose held-out utterances it "
        f"must hold out too: drop --num_test\n")
    other = _tts_run(tmp_path / "tts_hop", tiny_corpus, hop_length=128)
    assert refused("--tts_run", other) == (f"error: --tts_run {other}: its TTS model predicts another mel than this "
                                           f"vocoder's (hop_length 128 there, 256 here): give this vocoder --hop_length 128\n")
    assert parse("--tts_run", other, "--hop_length", "128", "--segment_frames", "64").hop_length == 128
    vocoder_run = tmp_path / "vocoder_run"
    vocoder_run.mkdir()
    save_config(train.Config(), vocoder_run / "config.yaml")
    (tts / "final").mkdir()
    (tts / "final" / "COMPLETE").write_text("{}")
    for folder, why in ((vocoder_run, "its config.yaml has no symbols (not a TTS run's)"),
                        (tts / "final", "is a sealed export or checkpoint"), (tmp_path, "no config.yaml in it"),
                        (tmp_path / "gone", "does not exist")):
        err = refused("--tts_run", folder)
        assert why in err and "give the --output_dir of a recipes/tts training run" in err, err


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def continuous(tiny_corpus, reference):
    """Runs never interrupted, per process count (trained once per test run)."""
    return lambda nproc: reference("vocoder", nproc, lambda out: args_for(tiny_corpus, out, *STEPS))


def assert_same_discriminators(a: Path, b: Path) -> None:
    wa, wb = (load_file(model_weights_files(p / "checkpoints" / "step_00000008")["discriminator"]) for p in (a, b))
    assert wa and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.accelerate_launch
@slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_vocoder_interrupted_equals_continuous(tiny_corpus, tmp_path, continuous, nproc):
    cut = tmp_path / "interrupted"
    run("vocoder", nproc, args_for(tiny_corpus, cut, *STEPS), kill_after_checkpoint=1,  # a generator-only step
        launcher=nproc == 1)  # harness.KILL_LEG
    run("vocoder", nproc, args_for(tiny_corpus, cut, *STEPS), kill_after_checkpoint=5, launcher=False)  # a middle leg: forked
    run("vocoder", nproc, args_for(tiny_corpus, cut, *STEPS))
    first, second = [step for step, _, _ in resumed_positions(tmp_path / "interrupted.log")]
    assert 1 <= first < 5 <= second < 8
    cont = continuous(nproc)
    assert metrics(cut) == metrics(cont)  # every loss, both learning rates and norms, every step once
    rows = metrics(cont)
    assert [r["d_loss"] == 0 for r in rows] == [True, True] + [False] * 6  # generator-only steps first
    assert rows[0]["d_lr"] == rows[1]["d_lr"] != rows[2]["d_lr"]  # D's schedule moves on its updates only
    assert len({r["epoch"] for r in rows}) > 1  # the run crossed an epoch
    assert_same_weights(cont, cut)  # final/: the generator
    assert_same_discriminators(cont, cut)


@slow
def test_vocoder_continues_on_fewer_processes(tiny_corpus, tmp_path, continuous):
    from tests.guarantees.test_elastic import LOSS_RTOL, compare

    extra = [*STEPS, "--dump_batch_ids", "true"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("vocoder", 2, args_for(tiny_corpus, cont, *extra))
    run("vocoder", 2, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=3)
    log = run("vocoder", 1, args_for(tiny_corpus, cut, *extra))
    assert "checkpoint: 2 process(es) × accumulation 2; now: 1 × 4" in log
    loss_rel, weight_abs = compare(cont, cut, key="g_loss")
    print(f"vocoder 2→1: max relative loss difference {loss_rel:.2e}, max absolute weight difference {weight_abs:.2e}")
    assert loss_rel < LOSS_RTOL and weight_abs < 1e-3


@slow
def test_preemption_saves_and_resumes_exactly(tiny_corpus, tmp_path, continuous):
    out = tmp_path / "run"
    log = run("vocoder", 2, args_for(tiny_corpus, out, *STEPS), when=checkpoint_exists(3),
              then=lambda proc: worker(proc, 1).send_signal(signal.SIGUSR1), expect_rc=1)
    assert "preempted at step" in log and "exit code 75" in log
    assert not (out / "final").exists()
    run("vocoder", 2, args_for(tiny_corpus, out, *STEPS))
    assert_same_weights(continuous(2), out)
    assert_same_losses(continuous(2), out, key="g_loss")
    assert_same_losses(continuous(2), out, key="d_loss")


def synthesize(*args: str) -> subprocess.CompletedProcess:
    """synthesize.py from another working directory (forked: harness.python)."""
    return python([ROOT / "recipes" / "tts" / "synthesize.py", *args], cwd=Path("/"))


@slow
def test_synthesize_with_the_vocoder_and_a_kill_during_its_export(tiny_corpus, tmp_path, continuous):
    tts = tmp_path / "tts"
    run("tts", 1, tts_args_for(tiny_corpus, tts, "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0"))
    voc = tmp_path / "vocoder"
    args = args_for(tiny_corpus, voc, "--max_steps", "2", "--save_steps", "2")
    run("vocoder", 1, args, env={"PYTHONPATH": str(SUPPORT), "SLOW_EXPORT": "5"},
        when=lambda o: (o / ".final.tmp" / "model.safetensors").is_file(), then=kill_tree, expect_rc=None)
    assert not (voc / "final").exists()
    wav = tmp_path / "out.wav"
    refused = synthesize("--checkpoint", str(tts), "--vocoder", str(voc), "--text", "a cat", "--output", str(wav))
    assert refused.returncode == 2 and "the export of this run did not finish" in refused.stderr
    run("vocoder", 1, args)  # the same command finishes the export
    assert sorted(p.name for p in (voc / "final").iterdir()) == ["COMPLETE", "README.md", "config.yaml",
                                                                 "model.safetensors", "vocoder_model.py"]
    done = synthesize("--checkpoint", str(tts), "--vocoder", str(voc / "final"), "--text", "a cat", "--output", str(wav))
    assert done.returncode == 0, done.stderr
    audio, sr = sf.read(wav)
    assert sr == 22050 and len(audio) > 0 and abs(audio).max() > 0
    for tool, extra in (("synthesize.py", ["--text", "a cat"]), ("score.py", [])):  # no vocoder to refine: refused
        refused = python([ROOT / "recipes" / "tts" / tool, "--checkpoint", tts, "--vocoder_refine_iters", "4", *extra],
                         cwd=Path("/"))
        assert refused.returncode == 2 and "--vocoder_refine_iters refines a neural vocoder's output" in refused.stderr
    raw = tmp_path / "raw.wav"  # the network's own output: another signal of the same length
    done = synthesize("--checkpoint", str(tts), "--vocoder", str(voc), "--vocoder_refine_iters", "0", "--text", "a cat",
                      "--output", str(raw))
    assert done.returncode == 0, done.stderr
    assert sf.read(raw)[0].shape == audio.shape and not np.allclose(sf.read(raw)[0], audio)

    scored = python([ROOT / "recipes" / "vocoder" / "evaluate.py", "--checkpoint", voc, "--num_test", "2",
                     "--num_images", "1", "--per_band", "true"], cwd=Path("/"))
    assert scored.returncode == 0, scored.stderr
    report = json.loads((voc / "eval_test.json").read_text())
    assert len(report["utterances"]) == 2 and set(report["mean"]) == {
        f"{v}_{m}" for v in ("griffin_lim", "vocoder") for m in ("pesq", "stoi", "mcd", "rtf")}
    assert report["refine_iters"] == 32  # config.yaml's: the run's own, unless --refine_iters says otherwise
    assert len(list(voc.glob("*.png"))) == 1 and "| vocoder, refine_iters 32 |" in (voc / "eval_test.md").read_text()
    bands = report["stoi_bands"]  # --per_band: 15 bands per vocoder, the mean over bands is the STOI
    assert bands["utterances"] == 2 and len(bands["centre_hz"]) == len(bands["vocoder"]) == 15
    assert len(bands["vocoder_magnitude"]) == 15 and bands["vocoder_magnitude"] != bands["vocoder"]
    assert abs(sum(bands["vocoder"]) / 15 - report["mean"]["vocoder_stoi"]) < 1e-9
    shown, rows = assert_page_rows(voc / "eval_test.html", report["utterances"],  # the page: the JSON's figures
                                   [f"{v}_{m}" for v in ("griffin_lim", "vocoder") for m in ("pesq", "stoi", "mcd")],
                                   files=("recording", "griffin_lim", "vocoder"))
    assert float(shown["mean vocoder_mcd"]) == pytest.approx(report["mean"]["vocoder_mcd"], rel=1e-3)
    assert [r.get("image") is not None for r in rows] == [True, False]  # --num_images 1

    chain = python([ROOT / "recipes" / "tts" / "score.py", "--checkpoint", tts, "--vocoder", voc, "--split", "validation"],
                   cwd=Path("/"))
    assert chain.returncode == 0, chain.stderr
    summary = json.loads((tts / "eval" / "final+vocoder" / "validation.json").read_text())
    assert summary["vocoder"] == str(voc) and summary["utterances"] > 0 and summary["mcd_vocoder_floor"] > 0

    other = tmp_path / "vocoder_hop128"  # a vocoder of another mel: refused with one line
    run("vocoder", 1, args_for(tiny_corpus, other, "--max_steps", "1", "--hop_length", "128", "--segment_frames", "24"))
    refused = synthesize("--checkpoint", str(tts), "--vocoder", str(other), "--text", "a cat", "--output", str(wav))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "trained on another mel than this TTS model (hop_length 128 vs 256)" in refused.stderr


@slow
def test_init_from_another_voice_takes_the_generator_and_from_a_checkpoint_the_discriminators(tiny_corpus, tmp_path,
                                                                                             continuous):
    """--init_from: from a checkpoint both models (a launched run whose first update is ~0: its
    step-1 weights are the source's), from an export the generator alone; another mel or another
    shape refused with what to set."""
    base = continuous(1)
    ckpt = base / "checkpoints" / "step_00000008"
    out = tmp_path / "voice"
    log = run("vocoder", 1, args_for(tiny_corpus, out, "--max_steps", "1", "--save_steps", "1", "--init_from", str(ckpt),
                                     "--warmup_steps", "1000000000"))  # LR 5e-13 at step 1: the weights stay the source's
    assert f"initialized from {ckpt}: generator and discriminator\n" in log
    for name in ("generator", "discriminator"):
        mine, theirs = (load_file(model_weights_files(c)[name]) for c in (out / "checkpoints" / "step_00000001", ckpt))
        assert mine.keys() == theirs.keys() and all(torch.allclose(mine[k], theirs[k], atol=1e-8) for k in mine), name

    train = recipe_modules("vocoder", "train").train
    cfg = load_config(base / "final", train.Config)
    models = {"generator": train.build_generator(cfg), "discriminator": train.build_discriminators(cfg)}
    fresh_d = {k: v.clone() for k, v in models["discriminator"].state_dict().items()}
    export = {"generator": base / "final" / "model.safetensors"}  # what build_models takes from an export
    line = vocoder.model.transfer_from(models, base / "final", cfg, export)
    assert "generator (the discriminators start fresh" in line
    final = load_file(base / "final" / "model.safetensors")
    assert all(torch.equal(v, final[k]) for k, v in models["generator"].state_dict().items())
    assert all(torch.equal(v, fresh_d[k]) for k, v in models["discriminator"].state_dict().items())
    tts_ckpt = tmp_path / "tts_step"  # another recipe's checkpoint (its one model is "model"), as the vocoder reads it
    tts_ckpt.mkdir()
    (tts_ckpt / "config.yaml").write_text((base / "final" / "config.yaml").read_text())
    (tts_ckpt / "train_state.json").write_text(json.dumps({"models": ["model"]}))
    with pytest.raises(ValueError, match=r"not a vocoder run \(its models: model\)"):
        vocoder.model.transfer_from(models, tts_ckpt, cfg, model_weights_files(tts_ckpt))
    (tts_ckpt / "train_state.json").write_text("{}")  # names no models: refused, not taken as nothing to load
    with pytest.raises(ValueError, match=r"not a vocoder run \(its models: none named\)"):
        vocoder.model.transfer_from(models, tts_ckpt, cfg, model_weights_files(tts_ckpt))
    for change, match in (({"hop_length": 128}, r"trained on another mel \(hop_length 256 vs 128\)"),
                          ({"dim": 24}, "its generator has another shape"),
                          ({"magnitude_prior": not cfg.magnitude_prior},
                           f"its generator has magnitude_prior {cfg.magnitude_prior}, this run {not cfg.magnitude_prior}")):
        other = dataclasses.replace(cfg, **change)
        with pytest.raises(ValueError, match=match):
            vocoder.model.transfer_from({"generator": train.build_generator(other)}, base / "final", other, export)


@slow
def test_transfer_script_trains_the_base_once_then_the_voice_from_its_last_checkpoint(tiny_corpus, tmp_path):
    """recipes/vocoder/transfer.sh: stage 1 (the base, here the tiny corpus standing in for the
    built-in voice), stage 2 (the voice, --init_from the base's last checkpoint: generator and
    discriminators); run again, it skips stage 1 and leaves stage 2's finished run as it was.
    `accelerate launch` stands in as a forked `python` (harness.accelerate_stand_in; the launcher is not what is tested here)."""
    import os

    from tests.harness.harness import accelerate_stand_in, cpu_tokens, on_cores

    shim = accelerate_stand_in(tmp_path)
    base, out, voice = tmp_path / "base", tmp_path / "voice", tiny_corpus / "ljspeech"
    env = {**os.environ, "ACCELERATE": str(shim), "BASE": str(base), "OUT": str(out), "BASE_STEPS": "3",
           "MAX_STEPS": "2", "BASE_ARGS": " ".join([*TINY, "--data_dir", str(voice), "--save_steps", "2"]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def transfer():
        with cpu_tokens(1) as cpus:
            voice_args = TINY[:TINY.index("--init_from")]  # the script gives stage 2 its own --init_from
            return subprocess.run(["bash", str(ROOT / "recipes/vocoder/transfer.sh"), str(voice), *voice_args, "--save_steps", "2"],
                                  env=env, capture_output=True, text=True, timeout=600, preexec_fn=on_cores(cpus))

    first = transfer()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "1/2 the built-in voice" in first.stdout
    last = base / "checkpoints" / "step_00000003"  # the base's last step, not its export: D comes too
    assert f"2/2 {voice} from {last}" in first.stdout
    assert f"initialized from {last}: generator and discriminator\n" in first.stderr
    saved = load_config(out / "final", recipe_modules("vocoder", "train").train.Config)
    assert (saved.init_from, saved.max_seconds, saved.max_steps) == (str(last), 30.0, 2)
    weights = (out / "final" / "model.safetensors").read_bytes()

    again = transfer()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "1/2" not in again.stdout and "2/2" in again.stdout
    assert (out / "final" / "model.safetensors").read_bytes() == weights

    missing = subprocess.run(["bash", str(ROOT / "recipes/vocoder/transfer.sh"), str(tmp_path / "nowhere")],
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr


@slow
def test_a_tts_runs_vocoder_starts_from_the_builtin_base_and_the_tts_tools_take_it(tiny_corpus, tmp_path, reference):
    """--tts_run with --init_from builtin: the base is trained once (a child run on the built-in corpus; its
    last checkpoint, the generator and both discriminators, is what the voice starts from), the vocoder
    trains on the TTS run's data into <run>/vocoder; a second voice starts from the cached base at once;
    synthesize.py and score.py (--vocoder auto, their default) then vocode with it, and say so."""
    from tests.tools.test_demo import trained_tts

    tts = tmp_path / "tts"
    shutil.copytree(trained_tts(reference, tiny_corpus), tts)  # the suite's shared run, copied: this test writes into it
    base_yaml = tmp_path / "base.yaml"  # the base: 3 steps on the tiny corpus (its 2 validation, 2 test utterances)
    base_yaml.write_text("num_valid: 2\nnum_test: 2\nmax_steps: 3\nsave_steps: 2\nmax_batch_seconds: 8\nreport_to: none\n")
    builtin = ["--init_from", "builtin", "--base_config", str(base_yaml), "--builtin_corpus", "tiny",
               "--data_cache_dir", str(tiny_corpus.parent)]
    first = run("vocoder", 1, last_flag_wins([*TINY, "--tts_run", str(tts), "--output_dir", str(tts / "vocoder"),
                                              "--max_steps", "2", *builtin]))
    assert first.count("training it once for this machine") == 1
    base = re.search(r"initialized from (\S+)/checkpoints/step_00000003: generator and discriminator\n", first).group(1)
    assert Path(base).parent == tiny_corpus.parent and Path(base).name.startswith("vocoder_base-")
    saved = load_config(tts / "vocoder" / "final", recipe_modules("vocoder", "train").train.Config)
    assert (saved.tts_run, saved.data_dir, saved.max_seconds) == (str(tts), str(tiny_corpus / "ljspeech"), 30.0)
    second = run("vocoder", 1, args_for(tiny_corpus, tmp_path / "voice2", "--max_steps", "1", *builtin))
    assert "training it once" not in second
    assert f"initialized from {base}/checkpoints/step_00000003: generator and discriminator\n" in second

    said = synthesize("--checkpoint", str(tts), "--text", "a cat", "--output", str(tmp_path / "a.wav"))
    assert said.returncode == 0 and f"--vocoder auto: the voice's own vocoder, {tts / 'vocoder'} " in said.stdout, said.stderr
    scored = python([ROOT / "recipes" / "tts" / "score.py", "--checkpoint", tts, "--split", "validation"], cwd=Path("/"))
    assert scored.returncode == 0, scored.stderr
    summary = json.loads((tts / "eval" / "final+vocoder" / "validation.json").read_text())
    assert summary["vocoder"] == str(tts / "vocoder") and summary["pesq_vocoder_floor"] > 0
