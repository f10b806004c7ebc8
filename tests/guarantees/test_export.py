"""Trained models leave the repository: transformers loads them and computes what the recipes do; the
TTS export loads from anywhere; every final/ carries a model card; tools never write into a sealed folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import AutoFeatureExtractor, AutoModel, AutoModelForCTC, pipeline

from common.model.encoder import encoder_config
from common.model.features import LogMel
from common.model.hf_export import load_recipe_ctc_weights, save_feature_extractor, write_model_card
from common.data.manifest import read_librispeech
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import ROOT, python, run
from tests.recipes.test_asr import short_run
from tests.recipes.test_tts import args_for as tts_args_for

asr = recipe_modules("asr", "text", "model", "ctc_decode")
CFG = encoder_config(input_dim=320, hidden_size=32, num_layers=2, num_heads=2, ffn_dim=64, conv_kernel=7, dropout=0.1)


def speech(seconds=2.3, seed=0):
    rng = np.random.RandomState(seed)
    t = np.arange(int(16000 * seconds))
    return (0.1 * np.sin(t * 0.05) * np.sin(t * 0.0007) + 0.02 * rng.randn(len(t))).astype("float32")


def recipe_features(model, wav):
    """What the recipe feeds the encoder: LogMel → whole 40 ms frames → normalized → stacked."""
    feats = LogMel(16000, 80)(torch.from_numpy(wav))
    T = feats.shape[0] // 4 * 4
    return feats[None, :T], torch.tensor([T])


def test_asr_export_equals_the_recipe(tmp_path):
    torch.manual_seed(0)
    tok = asr.text.CharTokenizer()
    model = asr.model.ConformerCTC(CFG, n_mels=80, stack_frames=4, vocab_size=tok.vocab_size).eval()
    model.feat_mean.normal_()
    model.feat_std.uniform_(0.5, 2.0)
    cfg = type("Cfg", (), dict(n_mels=80, stack_frames=4, sample_rate=16000, hidden_size=32, num_layers=2,
                               num_heads=2, ffn_dim=64, conv_kernel=7, dropout=0.1))
    asr.model.export_hf(tmp_path, dict(model.state_dict()), cfg, tok)

    extractor = AutoFeatureExtractor.from_pretrained(tmp_path, trust_remote_code=True)
    hf = AutoModelForCTC.from_pretrained(tmp_path).eval()
    for seed, seconds in ((0, 2.3), (1, 1.01), (2, 3.7)):
        wav = speech(seconds, seed)
        feats, lens = recipe_features(model, wav)
        x = extractor(wav, sampling_rate=16000, return_tensors="pt")
        ours = model.normalize(feats).reshape(1, -1, 320)
        assert torch.equal(x["input_features"], ours)  # the same front end, statistics included
        with torch.no_grad():
            log_probs, out_lens = model(feats, lens)
            theirs = torch.log_softmax(hf(**x).logits.float(), dim=-1)
        assert torch.equal(theirs, log_probs)
        text = pipeline("automatic-speech-recognition", model=str(tmp_path), trust_remote_code=True)(
            {"raw": wav, "sampling_rate": 16000})["text"]
        assert text == tok.decode(asr.ctc_decode.ctc_greedy(log_probs[0, : out_lens[0]]))
    assert torch.equal(load_recipe_ctc_weights(tmp_path)["head.weight"], model.head.weight)


def test_best_rq_encoder_export_gives_the_recipe_hidden_states(tmp_path):
    from common.model.encoder import StackedLogMelEncoder

    torch.manual_seed(1)
    enc = StackedLogMelEncoder(CFG, n_mels=80, stack_frames=4).eval()
    enc.feat_mean.normal_()
    enc.feat_std.uniform_(0.5, 2.0)
    enc.encoder.save_pretrained(tmp_path)
    save_feature_extractor(tmp_path, n_mels=80, stack_frames=4, sample_rate=16000, mean=enc.feat_mean, std=enc.feat_std)
    wav = speech(2.0, 3)
    feats, lens = recipe_features(enc, wav)
    with torch.no_grad():
        ours, _ = enc.encode(enc.normalize(feats), lens)
        x = AutoFeatureExtractor.from_pretrained(tmp_path, trust_remote_code=True)(wav, sampling_rate=16000,
                                                                                 return_tensors="pt")
        theirs = AutoModel.from_pretrained(tmp_path).eval()(**x).last_hidden_state
    assert torch.equal(theirs, ours)


@pytest.mark.slow
def test_pipeline_agrees_with_the_recipe_on_the_test_split(tiny_corpus, tmp_path, reference):
    """A short training run; then transformers' pipeline on final/ and decode.py (greedy) on the test
    split give the same text for every utterance. decode.py writes beside final/, which stays as sealed;
    final/ carries its model card, covered by the COMPLETE digests."""
    out = short_run(reference, tiny_corpus, tmp_path / "asr")
    sealed = tree_digest(out / "final")
    python([ROOT / "recipes" / "asr" / "decode.py", "--checkpoint", out, "--split", "test",
            "--data_dir", tiny_corpus / "librispeech"]).check_returncode()
    assert tree_digest(out / "final") == sealed  # nothing written into the sealed folder
    ours = {r["id"]: r["hyp"] for r in map(json.loads, (out / "decode" / "final" / "test-greedy.jsonl").read_text().splitlines())}
    card = (out / "final" / "README.md").read_text()
    assert "README.md" in json.loads((out / "final" / "COMPLETE").read_text())["files"]
    assert "accelerate launch " in card and "train.py" in card and "--max_steps 30" in card
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert json.dumps(last) in card and str(tiny_corpus / "librispeech") in card
    asr_pipe = pipeline("automatic-speech-recognition", model=str(out / "final"), trust_remote_code=True)
    test = read_librispeech(tiny_corpus / "librispeech", "test")
    theirs = {row["id"]: asr_pipe({"raw": sf.read(row["path"], dtype="float32")[0], "sampling_rate": 16000})["text"]
              for row in test}
    agree = sum(theirs[k] == ours[k] for k in ours)
    print(f"pipeline == decode.py greedy on {agree} of {len(ours)} test utterances")
    assert len(ours) == len(test) and agree == len(ours), {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_model_card_says_how_the_model_was_made(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "eval_loss": 1.7}\n'
                       '{"step": 3, "loss": 1.25}\n{"step": 4, "lo')  # a torn last line
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "recipes/asr/train.py"), "--max_steps", "3", "--output_dir", "out dir"])
    state = SimpleNamespace(step=3, world_size=2, gradient_accumulation_steps=1,
                            data={"utterances": 48, "hours": 0.0312, "fingerprint": "abc123"})
    write_model_card(tmp_path, recipe="asr", state=state, data_dir="/data/ls", metrics_path=metrics,
                     usage="""
        ```python
        x = 1
        ```""")
    card = (tmp_path / "README.md").read_text()
    assert f"`accelerate launch recipes/asr/train.py --max_steps 3 --output_dir 'out dir'` (2 process(es), in `{ROOT}`)" in card
    assert "48 utterances, 0.031 h, fingerprint `abc123`" in card and "`/data/ls`" in card
    assert '{"step": 3, "loss": 1.25}' in card and '{"step": 2, "loss": 1.5, "eval_loss": 1.7}' in card
    assert "torch " in card and "accelerate " in card and "UTC" in card and "\n```python\nx = 1\n```" in card


def test_model_card_lists_every_launch_of_a_resumed_run(tmp_path):
    """A run resumed twice: each launch's command with the steps it trained (was: the last one's alone);
    a run resumed from a checkpoint older than these records says which steps it cannot name."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 9, "loss": 1.0, "eval_loss": 1.1}\n')
    launch = lambda step, n, steps: {"from_step": step, "command": f"accelerate launch recipes/asr/train.py --max_steps {steps}",  # noqa: E731
                                     "cwd": "/runs", "processes": n}
    state = SimpleNamespace(step=9, world_size=1, gradient_accumulation_steps=1, data={},
                            launches=[launch(0, 2, 9), launch(4, 2, 9), launch(4, 2, 9), launch(6, 1, 9)])  # the 2nd killed before a checkpoint
    write_model_card(tmp_path, recipe="asr", state=state, data_dir="/d", metrics_path=metrics, usage="")
    card = (tmp_path / "README.md").read_text()
    assert ("- commands: 3 launches, each resuming from the last checkpoint of the one before\n"
            "  - steps 0–4: `accelerate launch recipes/asr/train.py --max_steps 9` (2 process(es), in `/runs`)\n"
            "  - steps 4–6: `accelerate launch recipes/asr/train.py --max_steps 9` (2 process(es), in `/runs`)\n"
            "  - steps 6–9: `accelerate launch recipes/asr/train.py --max_steps 9` (1 process(es), in `/runs`)\n") in card
    state.launches = [launch(6, 1, 9)]
    write_model_card(tmp_path, recipe="asr", state=state, data_dir="/d", metrics_path=metrics, usage="")
    card = (tmp_path / "README.md").read_text()
    assert ("  - steps 0–6: not recorded (checkpoints written before launches were)\n"
            "  - steps 6–9: `accelerate launch recipes/asr/train.py --max_steps 9` (1 process(es), in `/runs`)\n") in card


def test_a_relaunch_that_trains_no_step_keeps_the_runs_last_validation_on_the_card(tmp_path):
    """A finished run re-launched (it resumes at --max_steps, trains nothing and exports again):
    metrics.jsonl, trimmed to the resumed step, keeps the earlier launch's rows, and the card reads
    its last validation from them, not "(none logged)"."""
    from common.training.logs import MetricsLog

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 2, "loss": 1.5, "eval_loss": 1.7}\n{"step": 3, "loss": 1.25}\n')
    MetricsLog(SimpleNamespace(is_main_process=True), metrics, resume_step=3)  # the re-launch's start
    launch = lambda step: {"from_step": step, "command": "accelerate launch recipes/asr/train.py --max_steps 3",  # noqa: E731
                           "cwd": "/runs", "processes": 1}
    state = SimpleNamespace(step=3, world_size=1, gradient_accumulation_steps=1, data={}, launches=[launch(0), launch(3)])
    write_model_card(tmp_path, recipe="asr", state=state, data_dir="/d", metrics_path=metrics, usage="")
    card = (tmp_path / "README.md").read_text()
    assert '- last validation: `{"step": 2, "loss": 1.5, "eval_loss": 1.7}`' in card
    assert '- last logged step: `{"step": 3, "loss": 1.25}`' in card


@pytest.mark.slow
def test_tts_export_loads_from_anywhere_and_score_writes_beside_it(tiny_corpus, tmp_path):
    """final/ copied elsewhere synthesizes in a process whose sys.path holds only that folder and
    site-packages (no repository, no recipe folder), the same samples as synthesize.py; score.py
    writes beside final/, which stays as sealed."""
    out = tmp_path / "run"
    run("tts", 1, tts_args_for(tiny_corpus, out, "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0"))
    assert (out / "final" / "README.md").is_file()
    text = "she could not believe the farmer"
    python([ROOT / "recipes" / "tts" / "synthesize.py", "--checkpoint", out, "--text", text,
            "--output", tmp_path / "repo.wav", "--griffin_lim_iters", "2"]).check_returncode()

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "final", elsewhere / "my_tts")
    from tests.guarantees.test_sealed_exports import WITHOUT_THE_REPOSITORY

    script = WITHOUT_THE_REPOSITORY + f"""
assert not any("recipes" in p or p == {str(ROOT)!r} for p in sys.path), sys.path
sys.path.insert(0, "my_tts")
import soundfile as sf
from tts_audio import make_vocoder
from tts_model import load_tts, synthesize
model, cfg, symbols, _ = load_tts("my_tts")
wav, _, _ = synthesize(model, symbols, {text!r}, make_vocoder(cfg, n_iter=2))
sf.write("out.wav", wav.numpy(), cfg.sample_rate, subtype="PCM_16")
"""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}  # as the tools run here
    subprocess.run([sys.executable, "-I", "-c", script], check=True, cwd=elsewhere, env=env)
    ours, sr = sf.read(tmp_path / "repo.wav", dtype="int16")
    theirs, sr2 = sf.read(elsewhere / "out.wav", dtype="int16")
    assert sr == sr2 == 22050 and np.array_equal(ours, theirs)

    sealed = tree_digest(out / "final")
    python([ROOT / "recipes" / "tts" / "score.py", "--checkpoint", out, "--griffin_lim_iters", "2",
            "--asr_recordings", "false"]).check_returncode()
    assert tree_digest(out / "final") == sealed
    assert json.loads((out / "eval" / "final" / "test.json").read_text())["utterances"] == 2


def test_asr_and_best_rq_exports_load_without_the_repository(tmp_path):
    """The transformers exports, copied into an empty folder, load as their model cards say in a
    fresh interpreter that cannot import this repository: the same text and hidden states."""
    from common.model.encoder import StackedLogMelEncoder
    from tests.guarantees.test_sealed_exports import WITHOUT_THE_REPOSITORY

    torch.manual_seed(0)
    tok = asr.text.CharTokenizer()
    model = asr.model.ConformerCTC(CFG, n_mels=80, stack_frames=4, vocab_size=tok.vocab_size).eval()
    cfg = type("Cfg", (), dict(n_mels=80, stack_frames=4, sample_rate=16000, hidden_size=32, num_layers=2,
                               num_heads=2, ffn_dim=64, conv_kernel=7, dropout=0.1))
    asr.model.export_hf(tmp_path / "asr", dict(model.state_dict()), cfg, tok)
    enc = StackedLogMelEncoder(CFG, n_mels=80, stack_frames=4).eval()
    enc.encoder.save_pretrained(tmp_path / "best_rq" / "encoder")
    save_feature_extractor(tmp_path / "best_rq" / "encoder", n_mels=80, stack_frames=4, sample_rate=16000,
                           mean=enc.feat_mean, std=enc.feat_std)
    wav = speech(2.3, 0)
    np.save(tmp_path / "wav.npy", wav)
    empty = tmp_path / "empty"
    empty.mkdir()
    script = WITHOUT_THE_REPOSITORY + f"""
import numpy as np, torch
from transformers import AutoFeatureExtractor, AutoModel, pipeline
wav = np.load({str(tmp_path / "wav.npy")!r})
print(pipeline("automatic-speech-recognition", model={str(tmp_path / "asr")!r}, trust_remote_code=True)(
    {{"raw": wav, "sampling_rate": 16000}})["text"])
encoder = {str(tmp_path / "best_rq" / "encoder")!r}
fe = AutoFeatureExtractor.from_pretrained(encoder, trust_remote_code=True)
with torch.no_grad():
    hidden = AutoModel.from_pretrained(encoder).eval()(**fe(wav, sampling_rate=16000, return_tensors="pt")).last_hidden_state
torch.save(hidden, "hidden.pt")
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-I", "-c", script], cwd=empty, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    feats, lens = recipe_features(model, wav)
    with torch.no_grad():
        log_probs, out_lens = model(feats, lens)
        ours, _ = enc.encode(enc.normalize(feats), lens)
    assert proc.stdout.splitlines()[-1] == tok.decode(asr.ctc_decode.ctc_greedy(log_probs[0, : out_lens[0]]))
    assert torch.equal(torch.load(empty / "hidden.pt"), ours)
