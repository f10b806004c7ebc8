"""ASR from a transformers speech encoder (--init_from a `save_pretrained` folder; common/model/hf_encoder.py):
tiny random models of each family made here (tests/recipes/tiny_encoders.py, no download). Units: the
folder rules (foreign or broken checkpoints refused in one line, pre-training extras dropped with one
log line), the model's own masking drawn from the loop's seed, our BEST-RQ encoder read through the same
path, a streamed `datasets` source resampled to the model's rate. End to end, for each family (wav2vec 2.0,
HuBERT, WavLM, w2v-BERT) in 1 and in 2 processes: a run SIGKILLed after its first checkpoint and re-launched
equals the run never interrupted bit for bit, and that uninterrupted run's export is the stock
<Family>ForCTC that `pipeline` loads without remote code and that transcribes as decode.py does. w2v-BERT's
2-process run, killed, continues on 1 process (elastic); lm.py and decode.py --lm work on a wav2vec 2.0 run."""

from __future__ import annotations

import contextlib
import json
import logging

import numpy as np
import pytest
import torch

from common.data.manifest import read_librispeech
from common.model.hf_encoder import (build_encoder, encoder_weights, fetch_hub, load_encoder_weights,
                                     read_frontend)
from common.training.faults import RunError
from tests.harness.recipe_import import recipe_modules
from tests.conftest import suite_dir
from tests.harness.harness import ROOT, assert_same_losses, assert_same_weights, python, resumed_positions, run
from tests.recipes.tiny_encoders import FAMILY_NAMES, tiny_encoder

asr = recipe_modules("asr", "text", "ctc_decode", "data", "model", "scoring", "train")
TINY = ["--warmup_steps", "2", "--logging_steps", "1", "--report_to", "none", "--seed", "42", "--max_batch_seconds", "16"]


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------


def test_foreign_or_broken_folders_are_refused_in_one_line(tmp_path, monkeypatch):
    folder = tiny_encoder("wav2vec2", tmp_path / "w2v")
    frontend = read_frontend(folder)
    assert frontend["model_type"] == "wav2vec2" and frontend["feature_extractor"]["do_normalize"]

    other = tmp_path / "whisper"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(RunError) as e:
        read_frontend(other)
    assert "'whisper'" in one_line(e) and "wav2vec2-bert" in str(e.value)

    config = json.loads((folder / "config.json").read_text())
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(RunError) as e:
        read_frontend(remote)
    assert "remote code" in one_line(e)

    bare = tmp_path / "no_extractor"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunError) as e:
        read_frontend(bare)
    assert "Wav2Vec2FeatureExtractor" in one_line(e)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"never read")
    with pytest.raises(RunError) as e:
        encoder_weights(pickled)
    assert "pytorch_model.bin" in one_line(e) and "save_pretrained" in str(e.value)

    weights = encoder_weights(folder)
    wider = build_encoder({**frontend, "config": {**config, "hidden_size": 48}}, {})
    with pytest.raises(RunError) as e:
        load_encoder_weights(wider, weights, "wav2vec2", folder)
    assert "misshapen" in one_line(e)
    with pytest.raises(RunError) as e:
        load_encoder_weights(build_encoder(frontend, {}), {**weights, "decoder.proj.weight": torch.zeros(1)}, "wav2vec2", folder)
    assert "unexpected ['decoder.proj.weight']" in one_line(e)
    with pytest.raises(RunError) as e:
        load_encoder_weights(build_encoder(frontend, {}), {k: v for k, v in weights.items() if "layers.1." not in k},
                             "wav2vec2", folder)
    assert "missing" in one_line(e)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RunError) as e:
        fetch_hub("facebook/wav2vec2-base")
    assert "huggingface-cli download facebook/wav2vec2-base" in one_line(e)


def test_pretraining_and_ctc_extras_are_dropped_with_one_log_line(tmp_path, caplog):
    """A Wav2Vec2ForPreTraining checkpoint (quantizer, project_q, project_hid) and a HubertForCTC's
    (lm_head, under its `hubert.` prefix) load into the bare encoder: what CTC does not use is dropped."""
    for family, cls in (("wav2vec2", "Wav2Vec2ForPreTraining"), ("hubert", "HubertForCTC")):
        folder = tiny_encoder(family, tmp_path / cls, model_class=cls)
        encoder = build_encoder(read_frontend(folder), {})
        weights = encoder_weights(folder)
        with caplog.at_level(logging.INFO, logger="common.model.hf_encoder"):
            caplog.clear()
            load_encoder_weights(encoder, weights, family, folder)
        [line] = [r.getMessage() for r in caplog.records]
        assert "dropped" in line and ("quantizer" in line if cls.endswith("PreTraining") else "lm_head" in line)
        prefix = "wav2vec2." if cls.endswith("PreTraining") else "hubert."
        own = encoder.state_dict()
        assert all(torch.equal(own[k[len(prefix):]], v) for k, v in weights.items()
                   if k.startswith(prefix) and k[len(prefix):] in own)


@pytest.mark.parametrize("family", ["wav2vec2", "wavlm"])
def test_the_models_own_masking_is_a_function_of_the_torch_seed(tmp_path, family):
    """transformers draws SpecAugment from numpy's global RNG: the model seeds it from torch's (which the
    loop reseeds per batch position), so a resume redraws the same masks; numpy's state is left as it was.
    WavLM with feature masks runs at all (its config lacks mask_feature_min_masks)."""
    model = asr.model.HFEncoderCTC(read_frontend(tiny_encoder(family, tmp_path / family)), 29, dict(
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        apply_spec_augment=True, mask_time_prob=0.3, mask_time_length=2, mask_feature_prob=0.3, mask_feature_length=2))
    model.train()
    wav, lens = torch.randn(2, 8000), torch.tensor([8000, 6000])
    outs = []
    for numpy_seed in (1, 2):
        np.random.seed(numpy_seed)
        torch.manual_seed(7)
        outs.append(model(wav, lens)[0])
        assert np.random.get_state()[1][0] == np.random.RandomState(numpy_seed).get_state()[1][0]
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(8)
    assert not torch.equal(model(wav, lens)[0], outs[0])  # another position: other masks


OUR_SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_dim=64, conv_kernel=3)


def best_rq_like_run(root):
    """A BEST-RQ run's folders as its train.py writes them, without training (random weights, random
    statistics): final/ (recipe names, config.yaml, and encoder/ as its write_extras exports it) and
    checkpoints/step_00000001/, each sealed. Returns the run folder and its recipe-named weights."""
    import yaml
    from safetensors.torch import save_file

    from common.model.encoder import StackedLogMelEncoder, encoder_config_from
    from common.model.hf_export import save_feature_extractor
    from common.training.sealing import seal_export

    cfg = asr.train.Config(**OUR_SHAPE)  # the fields BEST-RQ's config shares with ASR's
    torch.manual_seed(0)
    model = StackedLogMelEncoder(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames)
    model.feat_mean.normal_()
    model.feat_std.uniform_(0.5, 2.0)
    weights = {**model.state_dict(), "quantizer.codebook": torch.randn(8, 4), "head.weight": torch.randn(8, 32)}
    saved = {k: getattr(cfg, k) for k in (*asr.train.MATCHING_KEYS, "dropout")}
    for folder in (root / "final", root / "checkpoints" / "step_00000001"):
        folder.mkdir(parents=True)
        save_file(weights, folder / "model.safetensors")
        (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    model.encoder.save_pretrained(root / "final" / "encoder")
    save_feature_extractor(root / "final" / "encoder", n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                           sample_rate=cfg.sample_rate, mean=model.feat_mean, std=model.feat_std)
    for folder in (root / "final", root / "checkpoints" / "step_00000001"):
        seal_export(folder)
    return root, weights


def test_our_best_rq_encoder_is_read_as_any_transformers_folder(tmp_path):
    """A BEST-RQ run's final/encoder/ (a Wav2Vec2BertModel whose front end is our log-mel, not a stock
    feature extractor) goes through --init_from's one path for transformers folders: its run folder and
    final/ resolve to it, a checkpoint (recipe names) and an ASR export (Wav2Vec2BertForCTC) give the same
    record; the ASR recipe fine-tunes its Conformer on it, weights and statistics loaded strictly. A shape
    other than the run's, a damaged seal around the folder, or a checkpoint of a transformers encoder's run
    are refused in one line."""
    import dataclasses

    from safetensors.torch import save_file

    from common.model.hf_encoder import is_logmel, load_logmel_encoder, read_pretrained
    from common.training.faults import UsageError

    run_dir, weights = best_rq_like_run(tmp_path / "best_rq")
    encoder_dir, step = run_dir / "final" / "encoder", run_dir / "checkpoints" / "step_00000001"
    record = read_pretrained(encoder_dir)
    assert is_logmel(record) and record["source"] == str(encoder_dir.resolve())
    assert read_pretrained(run_dir) == read_pretrained(run_dir / "final") == record  # the same folder
    cfg = asr.train.Config(output_dir=str(tmp_path / "asr"), init_from=str(encoder_dir), **OUR_SHAPE)
    assert asr.train.prepare_frontend(cfg, tmp_path / "asr") is None  # the recipe's Conformer on log-mel ...
    recorded = json.loads((tmp_path / "asr" / "frontend" / "frontend.json").read_text())
    assert recorded == record  # ... and what it started from, recorded for decode.py, never read again

    tokenizer = asr.text.CharTokenizer.from_texts(["ab c"])
    for start in (recorded, read_pretrained(step)):
        model = asr.model.ctc_model(cfg, tokenizer.vocab_size)
        load_logmel_encoder(model, start, cfg)
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items() if not k.startswith("head."))
    asr.model.export_hf(tmp_path / "asr_final", model.state_dict(), cfg, tokenizer)  # an ASR run's final/
    exported = read_pretrained(tmp_path / "asr_final")
    assert is_logmel(exported) and exported["feature_extractor"]["mean"] == record["feature_extractor"]["mean"]
    again = asr.model.ctc_model(cfg, tokenizer.vocab_size)
    load_logmel_encoder(again, exported, cfg)  # its CTC head (lm_head) dropped
    assert all(torch.equal(v, weights[k]) for k, v in again.state_dict().items() if not k.startswith("head."))

    with pytest.raises(RunError) as e:
        load_logmel_encoder(model, recorded, dataclasses.replace(cfg, hidden_size=48, stack_frames=2))
    assert "hidden_size: pre-trained 32 != this run 48" in one_line(e) and "stack_frames: pre-trained 4 != this run 2" in str(e.value)
    (step / "config.yaml").write_text("encoder_type: wav2vec2\n")
    with pytest.raises(RunError) as e:
        read_frontend(step)
    assert "give that run's final/" in one_line(e)
    (step / "config.yaml").write_text((run_dir / "final" / "config.yaml").read_text())  # a checkpoint of another model
    save_file({k: v for k, v in weights.items() if k != "feat_std"}, step / "model.safetensors")
    with pytest.raises(RunError) as e:
        read_frontend(step)
    assert "holds no feature statistics" in one_line(e)
    (run_dir / "final" / "config.yaml").write_text("edited: true\n")
    with pytest.raises(UsageError) as e:
        read_pretrained(encoder_dir)
    assert f"it is inside {run_dir / 'final'}, whose seal fails: damaged (config.yaml" in one_line(e)
    fe = json.loads((encoder_dir / "preprocessor_config.json").read_text())
    (encoder_dir / "preprocessor_config.json").write_text(json.dumps({**fe, "mean": fe["mean"][:-1]}))
    with pytest.raises(RunError) as e:
        read_frontend(encoder_dir)
    assert "lacks or misstates" in one_line(e)


def test_transformers_settings_on_the_conformer_are_refused(tmp_path):
    cfg = asr.train.Config(output_dir=str(tmp_path / "out"), mask_time_prob=0.05)
    with pytest.raises(RunError) as e:
        asr.train.prepare_frontend(cfg, tmp_path / "out")
    assert "--mask_time_prob is a transformers encoder's setting" in one_line(e)


# ---------------------------------------------------------------------------------------------
# End to end (tiny corpus)
# ---------------------------------------------------------------------------------------------


def train_args(corpus, out, init, *extra) -> list[str]:
    return ["--data_dir", str(corpus / "librispeech"), "--output_dir", str(out), "--init_from", str(init), *TINY, *extra]


def even_frames_copy(root, split: str, dest):
    """`root`/`split` (LibriSpeech layout) copied to `dest`, each file cut to an even count of 10 ms fbank
    frames (25 ms windows): what w2v-BERT's feature extractor stacks by 2 without a padded last frame."""
    import shutil

    import soundfile as sf

    shutil.copytree(root / split, dest / split)
    for path in (dest / split).rglob("*.flac"):
        wav, rate = sf.read(path, dtype="float32")
        if (1 + (len(wav) - 400) // 160) % 2:
            sf.write(path, wav[:-160], rate)
    return dest


# Per family and process count, one uninterrupted run (`continuous`: trained once per test run, shared by
# the tests that read it; it saves at its end only) and one SIGKILLed after its first checkpoint (`killed`:
# made once, each test resumes its own copy). The model's own time and feature masks, LayerDrop, dropout and
# speed perturbation on; batch ids logged (the elastic test compares them). 2 processes with accumulation 2.
RUNS = [(family, nproc) for family in FAMILY_NAMES for nproc in (1, 2)]
RESUME = ["--max_steps", "3", "--eval_steps", "0", "--mask_time_prob", "0.2",
          "--mask_time_length", "2", "--mask_feature_prob", "0.2", "--mask_feature_length", "2",
          "--layerdrop", "0.3", "--speed_perturb", "0.1", "--dump_batch_ids", "true"]


def run_args(corpus, nproc: int, out, init, save_steps: int = 1) -> list[str]:
    return train_args(corpus, out, init, *RESUME, "--save_steps", str(save_steps),
                      *(["--gradient_accumulation_steps", "2"] if nproc == 2 else []))


@contextlib.contextmanager
def made_once(folder):
    """Yields whether `folder` must be made (then made by the caller), once across pytest-xdist workers."""
    import fcntl
    import shutil

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker makes it, the others wait (released on close)
        todo = not (folder.parent / f"{folder.name}.done").exists()
        if todo:
            shutil.rmtree(folder, ignore_errors=True)  # what a failed test left half-done
        yield todo
        if todo:
            (folder.parent / f"{folder.name}.done").touch()


@pytest.fixture(scope="session")
def continuous(tiny_corpus, tmp_path_factory, reference):
    """`continuous(family, nproc)`: its uninterrupted run (`reference`), from a tiny encoder every worker shares."""
    def get(family: str, nproc: int):
        init = suite_dir(tmp_path_factory) / "tiny_encoders" / family
        with made_once(init) as todo:
            if todo:
                tiny_encoder(family, init)
        return reference("asr", nproc, lambda out: run_args(tiny_corpus, nproc, out, init, save_steps=3))
    return get


@pytest.fixture(scope="session")
def killed(tiny_corpus, tmp_path_factory):
    """`killed(family, nproc, dest)`: a copy in `dest` of its run SIGKILLed after checkpoint 1 (made once), and the
    arguments that re-launch it. The folder it started from was emptied after the kill: a resume reads the
    recorded front end, never the source (the same --init_from is given, as a re-launch does)."""
    import shutil

    def get(family: str, nproc: int, dest):
        root = suite_dir(tmp_path_factory) / "killed" / f"{family}-{nproc}"
        with made_once(root) as todo:
            if todo:
                init = tiny_encoder(family, root / "init")
                run("asr", nproc, run_args(tiny_corpus, nproc, root / "run", init), kill_after_checkpoint=1,
                    launcher=False)
                shutil.rmtree(init)
                init.mkdir()
        shutil.copytree(root / "run", dest)
        return run_args(tiny_corpus, nproc, dest, root / "init")
    return get


@pytest.mark.slow
@pytest.mark.parametrize("family,nproc", RUNS)
def test_hf_encoder_interrupted_equals_continuous(tmp_path, continuous, killed, family, nproc):
    """SIGKILL after checkpoint 1 and re-launch: bit-identical weights and losses to a run never interrupted."""
    cont, args = continuous(family, nproc), killed(family, nproc, tmp_path / "interrupted")
    run("asr", nproc, args)
    assert len(resumed_positions(tmp_path / "interrupted.log")) == 1
    assert_same_weights(cont, tmp_path / "interrupted")
    assert_same_losses(cont, tmp_path / "interrupted")


@pytest.mark.slow
def test_hf_encoder_continues_on_fewer_processes(tmp_path, continuous, killed):
    """Elastic resume: w2v-BERT's 2-process run, killed, continues on 1 process (accumulation 4): the same
    utterances per optimizer step as the run never interrupted, losses and weights close (the gradient
    sum is reduced in another order)."""
    from tests.guarantees.test_elastic import LOSS_RTOL, compare

    cont, args = continuous("wav2vec2-bert", 2), killed("wav2vec2-bert", 2, tmp_path / "interrupted")
    log = run("asr", 1, args)
    assert "checkpoint: 2 process(es) × accumulation 2; now: 1 × 4" in log
    assert len(resumed_positions(tmp_path / "interrupted.log")) == 1
    loss_rel, weight_abs = compare(cont, tmp_path / "interrupted")
    assert loss_rel < LOSS_RTOL and weight_abs < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("family,nproc", RUNS)
def test_a_family_trains_and_exports_a_stock_model_the_pipeline_reads(tiny_corpus, tmp_path, continuous, family,
                                                                      nproc):
    """The uninterrupted run of each family in 1 and in 2 processes (the kill/resume test's). final/:
    the stock <Family>ForCTC, feature extractor and Wav2Vec2CTCTokenizer, no code; `pipeline` without
    trust_remote_code transcribes every test utterance as decode.py does (the stock tokenizer keeps a
    doubled space where decode.py single-spaces). w2v-BERT's feature extractor pads an
    odd count of 10 ms fbank frames to a last, masked 20 ms frame, which the pipeline decodes too
    (decode.py: the valid frames only): its audio is given here at an even count."""
    import soundfile as sf
    from transformers import pipeline

    out = continuous(family, nproc)
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    ctc = asr.model.FAMILIES[family].ctc
    assert config["architectures"] == [ctc] and config["vocab_size"] == 29 and config["pad_token_id"] == 0
    assert not list(final.glob("*.py")) and "auto_map" not in (final / "tokenizer_config.json").read_text()
    assert "auto_map" not in (final / "preprocessor_config.json").read_text()
    data = even_frames_copy(tiny_corpus / "librispeech", "test", tmp_path / "data")
    proc = python([ROOT / "recipes/asr/decode.py", "--checkpoint", out, "--split", "test", "--data_dir", data,
                   "--max_batch_seconds", "1", "--output", tmp_path / "decode"],
                  stderr_to_stdout=True)  # one utterance per batch, as the pipeline
    assert proc.returncode == 0, proc.stdout[-3000:]
    decoded = {r["id"]: r["hyp"] for r in map(json.loads, (tmp_path / "decode/test-greedy.jsonl").read_text().splitlines())}
    asr_pipe = pipeline("automatic-speech-recognition", model=str(final))
    assert type(asr_pipe.model).__name__ == ctc
    test = read_librispeech(data, "test")
    for utt_id, path in zip(test["id"], test["path"]):
        wav, rate = sf.read(path, dtype="float32")
        assert " ".join(asr_pipe({"raw": wav, "sampling_rate": rate})["text"].split()) == decoded[utt_id]


@pytest.mark.slow
def test_the_lm_is_built_and_decodes_with_a_transformers_encoders_run(tiny_corpus, tmp_path, continuous):
    """lm.py on a wav2vec 2.0 run (its training transcripts), then decode.py --lm: every test utterance
    decoded with the LM, and the greedy side of the same posteriors scored as decode.py scores it."""
    pytest.importorskip("kenlm", reason="pip install -r requirements-lm.txt")
    out = continuous("wav2vec2", 1)
    proc = python([ROOT / "recipes/asr/lm.py", "--checkpoint", out, "--order", "2", "--output_dir", tmp_path / "lm"],
                  stderr_to_stdout=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = python([ROOT / "recipes/asr/decode.py", "--checkpoint", out, "--split", "test", "--lm", tmp_path / "lm",
                   "--beam_width", "8", "--output", tmp_path / "decode"], stderr_to_stdout=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((tmp_path / "decode" / "test-lm.json").read_text())
    rows = (tmp_path / "decode" / "test-lm.jsonl").read_text().splitlines()
    test = read_librispeech(tiny_corpus / "librispeech", "test")
    assert summary["decoding"] == "lm" and summary["utterances"] == len(rows) == len(test)
    assert 0 <= summary["cer_no_lm"] and summary["lm"] == str(tmp_path / "lm")


def test_a_streamed_source_reaches_the_model_at_its_rate(tiny_corpus, tmp_path, monkeypatch):
    """--dataset_name (parquet shards) --streaming true, with a transformers encoder whose feature
    extractor takes 8 kHz audio: the streamed training batches hold that extractor's output on the
    corpus's 16 kHz audio resampled to 8 kHz (`load_audio`), as a folder's would."""
    import soundfile as sf

    from common.data.loading import load_audio
    from tests.guarantees.test_dataset_source import OFFLINE, args_for, build, write_source

    for key, value in {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}.items():
        monkeypatch.setenv(key, value)
    source = write_source(tiny_corpus / "librispeech", tmp_path / "source")
    init = tiny_encoder("wav2vec2", tmp_path / "w2v")
    fe = json.loads((init / "preprocessor_config.json").read_text())
    (init / "preprocessor_config.json").write_text(json.dumps({**fe, "sampling_rate": 8000}))
    data = build("asr", args_for(source, tmp_path / "out", "--init_from", str(init), "--sample_rate", "8000",
                                 "--speed_perturb", "0"), tmp_path / "out")
    assert data.recorded == {"encoder_type": "wav2vec2"}
    batch = next(iter(data.train_loader))
    paths = dict(zip(*(lambda t: (t["id"], t["path"]))(read_librispeech(tiny_corpus / "librispeech", "train"))))
    extractor = asr.data.StockFrontend(json.loads((tmp_path / "out" / "frontend" / "frontend.json").read_text()))
    for utt_id, feats, n in zip(batch["ids"], batch["feats"], batch["feat_lens"]):
        assert sf.info(paths[utt_id]).samplerate == 16000
        assert torch.equal(feats[:n], extractor(load_audio(paths[utt_id], 8000)))
