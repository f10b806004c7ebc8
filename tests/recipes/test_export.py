"""Trained models leave the repository: transformers loads them and computes what the recipes do."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import AutoFeatureExtractor, AutoModel, AutoModelForCTC, pipeline

from common.encoder import encoder_config
from common.features import LogMel
from common.hf_export import load_recipe_ctc_weights, save_feature_extractor
from common.manifest import read_librispeech
from tests.recipe_import import recipe_modules
from tests.recipes.harness import command, run
from tests.recipes.test_asr import args_for

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
    from common.encoder import StackedLogMelEncoder

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
def test_pipeline_agrees_with_the_recipe_on_the_test_split(tiny_corpus, tmp_path):
    """A short training run; then transformers' pipeline on final/ and decode.py (greedy) on the test
    split give the same text for every utterance."""
    out = tmp_path / "asr"
    run("asr", 1, args_for(tiny_corpus, out, "--max_steps", "30", "--learning_rate", "3e-3", "--eval_steps", "0",
                           "--save_steps", "30"))
    decode = [a.replace("train.py", "decode.py") if a.endswith("train.py") else a for a in
              command("asr", 1, ["--checkpoint", str(out), "--split", "test", "--data_dir", str(tiny_corpus / "librispeech")])]
    subprocess.run(decode, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ours = {r["id"]: r["hyp"] for r in map(json.loads, (out / "final" / "decode" / "test-greedy.jsonl").read_text().splitlines())}
    asr_pipe = pipeline("automatic-speech-recognition", model=str(out / "final"), trust_remote_code=True)
    test = read_librispeech(tiny_corpus / "librispeech", "test")
    theirs = {row["id"]: asr_pipe({"raw": sf.read(row["path"], dtype="float32")[0], "sampling_rate": 16000})["text"]
              for row in test}
    agree = sum(theirs[k] == ours[k] for k in ours)
    print(f"pipeline == decode.py greedy on {agree} of {len(ours)} test utterances")
    assert len(ours) == len(test) and agree == len(ours), {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
