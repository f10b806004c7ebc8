"""ASR (Conformer-CTC): unit tests of tokens, decoding, metrics, augmentation and data; end to end
through `accelerate launch` in 1 and 2 processes: interrupted == continuous, --init_from a BEST-RQ
run (and refusal of a mismatched one), decode.py scoring each test utterance exactly once."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import jiwer
import pytest
import torch
import yaml
from safetensors.torch import load_file

import evaluate
from common.data.loading import load_audio
from common.model.features import LogMel, feature_stats
from common.model.hf_export import load_recipe_ctc_weights
from common.data.manifest import read_librispeech
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import (ROOT, assert_same_losses, assert_same_weights, epoch_lengths, last_flag_wins,
                                   metrics, python, resumed_positions, run)

SEED = 42
ENCODER = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64", "--conv_kernel", "7"]
TINY = [*ENCODER, "--warmup_steps", "5", "--logging_steps", "1", "--report_to", "none", "--seed", str(SEED),
        "--max_batch_seconds", "16", "--stats_utterances", "8", "--init_from", "none",  # (last flag wins: a test may start from a run)
        "--early_stopping_patience", "0"]  # the tiny corpus is a voice to auto: tests/guarantees/test_early_stopping.py tests it on
RECIPE = ROOT / "recipes" / "asr"


asr = recipe_modules("asr", "text", "ctc_decode", "data", "model", "scoring", "train")


def args_for(corpus: Path, out: Path, *extra: str) -> list[str]:
    return last_flag_wins(["--data_dir", str(corpus / "librispeech"), "--output_dir", str(out), *TINY, *extra])


SHORT_RUN = ["--max_steps", "30", "--learning_rate", "3e-3", "--eval_steps", "0", "--save_steps", "30"]


def short_run(reference, corpus: Path, dest: Path) -> Path:
    """A 30-step run on the tiny corpus, trained once per test run (the `reference` fixture) and
    copied to `dest` for a test that writes beside its final/ (decode/, an LM)."""
    shutil.copytree(reference("asr", 1, lambda out: args_for(corpus, out, *SHORT_RUN)), dest)
    return dest


def launch(script: str, nproc: int, args: list[str], log: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Any script of the recipe (harness.run drives train.py only), its output in `log`: forked, as
    `python <script>` or its cpu_ddp ranks (tests/harness/harness.py)."""
    proc = python([RECIPE / script, *args], nproc=nproc, timeout=timeout, stderr_to_stdout=True)
    log.write_text(proc.stdout)
    return proc


# ---------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------


def test_normalize_text():
    assert asr.text.normalize_text("  MR. O'BRIEN'S well-known CAFÉ,  2nd\tfloor ") == "mr o'brien's well known café 2nd floor"
    assert asr.text.normalize_text("HELLO WORLD") == "hello world"  # LibriSpeech: case only
    assert asr.text.normalize_text("... -- !") == ""


def test_char_tokenizer_round_trip(tmp_path):
    tok = asr.text.CharTokenizer()
    ids = tok.encode("Don't  PANIC!")
    assert asr.text.BLANK not in ids and tok.vocab_size == 29
    assert tok.decode(ids) == "don't panic"
    tok.save(tmp_path)
    assert asr.text.load_tokenizer(tmp_path).encode("abc") == tok.encode("abc")


def test_bpe_tokenizer_round_trip_and_determinism(tiny_corpus, tmp_path):
    texts = read_librispeech(tiny_corpus / "librispeech", "train")["text"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    asr.text.build_tokenizer("bpe", texts, a, 60)
    asr.text.build_tokenizer("bpe", texts, b, 60)
    assert (a / "bpe.model").read_bytes() == (b / "bpe.model").read_bytes()  # same pieces every time
    tok = asr.text.load_tokenizer(a)
    assert tok.kind == "bpe" and 29 < tok.vocab_size <= 61
    for t in texts[:10]:
        ids = tok.encode(t)
        assert asr.text.BLANK not in ids and len(ids) < len(asr.text.normalize_text(t))  # merges happened
        assert tok.decode(ids) == asr.text.normalize_text(t)


def test_ctc_greedy_merges_repeats_and_drops_blanks():
    # frames: a a <b> a b b <b>  →  "a a b" as ids [1, 1, 2]
    best = [1, 1, 0, 1, 2, 2, 0]
    lp = torch.full((7, 3), -10.0)
    lp[range(7), best] = 0.0
    assert asr.ctc_decode.ctc_greedy(lp) == [1, 1, 2]
    assert asr.ctc_decode.ctc_prefix_beam_search(lp, beam_size=4) == [1, 1, 2]


def test_ctc_beam_beats_greedy_on_crafted_case():
    # Two frames, P(blank) = 0.6, P(a) = 0.4 each. Greedy: blank blank → "" (0.36).
    # P("a") = P(a a) + P(a -) + P(- a) = 0.16 + 0.24 + 0.24 = 0.64: the better labelling.
    lp = torch.tensor([[0.6, 0.4], [0.6, 0.4]]).log()
    assert asr.ctc_decode.ctc_greedy(lp) == []
    assert asr.ctc_decode.ctc_prefix_beam_search(lp, beam_size=2) == [1]


def _labelling_probs(lp: torch.Tensor) -> dict[tuple[int, ...], float]:
    probs: dict[tuple[int, ...], float] = {}
    for path in itertools.product(range(lp.shape[1]), repeat=lp.shape[0]):
        labels = tuple(c for i, c in enumerate(path) if c != 0 and (i == 0 or c != path[i - 1]))
        probs[labels] = probs.get(labels, 0.0) + math.exp(sum(lp[t, c].item() for t, c in enumerate(path)))
    return probs


@pytest.mark.parametrize("seed", range(5))
def test_ctc_beam_search_finds_the_most_probable_labelling(seed):
    """Against brute force over all paths (5 frames, 3 classes): a wide beam is exact."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(5, 3, generator=g).mul(2).log_softmax(-1)
    probs = _labelling_probs(lp)
    assert abs(sum(probs.values()) - 1) < 1e-6
    assert tuple(asr.ctc_decode.ctc_prefix_beam_search(lp, beam_size=64)) == max(probs, key=probs.get)


def test_metric_modules_match_jiwer():
    refs = ["the cat sat on the mat", "hello world", "a b c d", "it's true"]
    hyps = ["the cat sat on mat", "hello word", "", "its true too"]
    scores = asr.scoring.Scorer()(hyps, refs)
    assert scores["wer"] == pytest.approx(jiwer.wer(refs, hyps))
    assert scores["cer"] == pytest.approx(jiwer.cer(refs, hyps))
    assert asr.scoring.Scorer()(refs, refs) == {"wer": 0.0, "cer": 0.0}
    # the modules are plain `evaluate` modules loaded from the repository (no download)
    module = evaluate.load(str(RECIPE / "metrics" / "wer"))
    out = module.compute(predictions=hyps, references=refs)
    assert out["wer"] == pytest.approx(jiwer.wer(refs, hyps)) and out["reference_words"] == 14


def test_gather_results_dedupes_by_id():
    rows = [("b", "x", "y"), ("a", "p", "q"), ("b", "x", "y")]  # a padded duplicate
    assert asr.scoring.gather_results(rows) == [("a", "p", "q"), ("b", "x", "y")]


def _collate(cfg, utt_ids, epoch):
    items = [(u, torch.zeros(300 + 17 * int(u[1:]), cfg.n_mels), [1, 2], "ab") for u in utt_ids]  # length: the id's
    collator = asr.data.SpecAugmentCollator(cfg, augment=True)
    collator.epoch = epoch
    return collator(items)


def test_spec_augment_is_a_function_of_seed_epoch_and_id():
    cfg = asr.train.Config(seed=3)
    a = _collate(cfg, ["u1", "u2", "u3"], epoch=0)
    b = _collate(cfg, ["u3", "u1"], epoch=0)  # another batch, other neighbours, other position
    n1 = int(a["feat_lens"][0])
    assert torch.equal(a["time_mask"][0, :n1], b["time_mask"][1, :n1])
    assert torch.equal(a["freq_mask"][0], b["freq_mask"][1])
    assert torch.equal(a["freq_mask"][2], b["freq_mask"][0])
    assert not a["time_mask"][0, n1:].any()  # padding never masked
    c = _collate(cfg, ["u1", "u2", "u3"], epoch=1)
    d = _collate(asr.train.Config(seed=4), ["u1", "u2", "u3"], epoch=0)
    assert not torch.equal(a["freq_mask"], c["freq_mask"]) or not torch.equal(a["time_mask"], c["time_mask"])
    assert not torch.equal(a["freq_mask"], d["freq_mask"]) or not torch.equal(a["time_mask"], d["time_mask"])
    torch.manual_seed(0)  # the global RNG plays no part
    assert torch.equal(_collate(cfg, ["u1", "u2", "u3"], epoch=0)["time_mask"], a["time_mask"])
    width = a["freq_mask"].sum(1)
    assert (width <= 2 * cfg.freq_mask_width).all() and a["time_mask"].sum(1).max() <= 2 * cfg.time_mask_width


def test_speed_perturbation_is_a_function_of_seed_epoch_and_id(tiny_corpus):
    manifest = asr.data.read_split(tiny_corpus / "librispeech", "train").select(range(6))
    cfg = asr.train.Config(seed=1)
    ds = asr.data.SpeechDataset(manifest, cfg, asr.text.CharTokenizer(), speed_perturb=0.2)
    lengths = {}
    for epoch in range(4):
        ds.epoch = epoch
        lengths[epoch] = [ds[i][1].shape[0] for i in range(6)]
        assert [ds[i][1].shape[0] for i in range(6)] == lengths[epoch]
    plain = [asr.data.SpeechDataset(manifest, cfg, asr.text.CharTokenizer())[i][1].shape[0] for i in range(6)]
    ratios = {round(p / n, 1) for e in lengths for p, n in zip(plain, lengths[e])}
    assert ratios == {0.8, 1.0, 1.2}  # 0.8× and 1.2× speed shorten/lengthen by 1/factor


def test_hf_saved_datasets_are_read_like_librispeech(tiny_corpus, tmp_path):
    import datasets

    libri = read_librispeech(tiny_corpus / "librispeech", "test")
    paths, texts = libri["path"], libri["text"]
    datasets.Dataset.from_dict({"path": paths, "text": texts}).save_to_disk(str(tmp_path / "a" / "test"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"audio": paths, "transcript": texts, "text": texts})
                          .cast_column("audio", datasets.Audio())}).save_to_disk(str(tmp_path / "b"))
    arrays = [load_audio(p, 16000).tolist() for p in paths]
    datasets.Dataset.from_dict({"audio": [{"array": a, "sampling_rate": 16000} for a in arrays], "text": texts,
                                "id": libri["id"]}).save_to_disk(str(tmp_path / "c" / "test"))
    for root in ("a", "b", "c"):
        m = asr.data.read_split(tmp_path / root, "test")
        assert len(m) == len(libri) and m["text"] == texts
        assert m["duration"] == pytest.approx(libri["duration"])
        for i in range(len(m)):
            assert torch.equal(asr.data.load_wav(m[i], 16000), load_audio(paths[i], 16000))
    assert asr.data.read_split(tmp_path / "c", "test")["id"] == libri["id"]


def write_audiofolders(corpus: Path, dest: Path) -> Path:
    """The tiny corpus's train and validation splits as `datasets` audiofolders, <dest>/<split>/metadata.csv
    (file_name, transcription, speaker) beside the audio in <dest>/<split>/clips/."""
    for split in ("train", "validation"):
        libri = read_librispeech(corpus / "librispeech", split)
        (dest / split / "clips").mkdir(parents=True)
        lines = ["file_name,transcription,speaker"]
        for row in libri:
            shutil.copy(row["path"], dest / split / "clips" / Path(row["path"]).name)
            lines.append(f"clips/{Path(row['path']).name},\"{row['text'].lower()}\",{row['speaker']}")
        (dest / split / "metadata.csv").write_text("\n".join(lines) + "\n")
    return dest


@pytest.mark.slow
def test_an_audiofolder_trains_and_decodes_like_a_librispeech_folder(tiny_corpus, tmp_path):
    """--data_dir <folder> with <folder>/<split>/metadata.csv (`datasets`' audiofolder): the recipe's
    data check reads it (its manifests sealed beside the run), trains two steps, and decode.py reads the
    same folder."""
    data = write_audiofolders(tiny_corpus, tmp_path / "af")
    out = tmp_path / "run"
    run("asr", 1, ["--data_dir", str(data), "--output_dir", str(out), *TINY, "--max_steps", "2", "--save_steps", "2",
                   "--eval_steps", "0", "--stats_utterances", "4"])
    assert (out / "final" / "COMPLETE").is_file()
    [manifest] = out.glob("data/train-*/manifest.jsonl")
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(rows) == len(read_librispeech(tiny_corpus / "librispeech", "train"))
    assert rows[0]["id"].startswith("clips-") and rows[0]["path"].startswith(str(data / "train" / "clips"))
    assert (manifest.parent / "COMPLETE").is_file()  # sealed: the TTS score can trust it as a judge's
    m = asr.data.read_split(data, "validation")  # decode.py's reader (no data check)
    assert len(m) == len(read_librispeech(tiny_corpus / "librispeech", "validation")) and m["text"][0].islower()


def test_labelled_subset_is_deterministic_and_nested(tiny_corpus):
    m = asr.data.read_split(tiny_corpus / "librispeech", "train")
    a = asr.data.labelled_subset(m, 0.25)["id"]
    assert len(a) == 12 and a == asr.data.labelled_subset(m, 0.25)["id"]
    assert set(a) < set(asr.data.labelled_subset(m, 0.5)["id"])
    assert set(asr.data.labelled_subset(m.shuffle(seed=0), 0.25)["id"]) == set(a)  # order-independent


def test_config_yaml_is_valid():
    from common.config import parse_config

    for yaml_file in sorted(RECIPE.glob("config*.yaml")):
        parse_config(asr.train.Config, argv=[], default_yaml=yaml_file)


# ---------------------------------------------------------------------------------------------
# End to end (slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.accelerate_launch
@pytest.mark.slow
def test_interrupted_equals_continuous_1proc(tiny_corpus, tmp_path):
    """Char tokens, SpecAugment, speed perturbation, validation WER/CER; SIGKILL inside epoch 1, resumed
    with data workers."""
    e0, e1 = epoch_lengths(read_librispeech(tiny_corpus / "librispeech", "train")["duration"], 16.0, 1, 2)
    assert e1 >= 5  # the run ends inside epoch 1, 2 steps after the cut (the last leg: steps, a validation, the export)
    k, max_steps = e0 + 2, e0 + 4
    extra = ["--max_steps", str(max_steps), "--save_steps", "1", "--eval_steps", "4", "--speed_perturb", "0.1",
             "--ema_decay", "0.99"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("asr", 1, args_for(tiny_corpus, cont, *extra), launcher=False)  # the reference: forked (the guarantee is the cut run's)
    run("asr", 1, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k)
    # Resumed with 2 data workers (speed perturbation, SpecAugment and validation in them): the same run.
    run("asr", 1, args_for(tiny_corpus, cut, *extra, "--num_workers", "2"))

    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    assert epoch == 1 and batch > 0
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    rows = metrics(cut)
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))  # one row per step
    evals = [r for r in rows if "eval_wer" in r]
    assert [r["step"] for r in evals] == sorted({*range(4, max_steps + 1, 4), max_steps})  # and at the end
    assert evals == [r for r in metrics(cont) if "eval_wer" in r]
    assert all(0 <= r["eval_cer"] <= 1.5 and "loss" in r for r in evals)
    # final/ holds everything needed to transcribe
    assert {p.name for p in (cont / "final").iterdir()} >= {"model.safetensors", "config.yaml", "tokenizer"}
    # --ema_decay: final/ (and a tool reading the last checkpoint) has the weight average, not the
    # trained weights the checkpoint resumes from
    weights = load_recipe_ctc_weights(cont / "final")
    last = cont / "checkpoints" / f"step_{max_steps:08d}"
    averaged, trained = load_recipe_ctc_weights(last), load_file(last / "model.safetensors")
    assert all(torch.equal(weights[k], averaged[k]) for k in averaged)
    assert not torch.equal(averaged["head.weight"], trained["head.weight"])
    # global normalization statistics from an evenly spaced subset of the training set, in buffers
    train = read_librispeech(tiny_corpus / "librispeech", "train")
    stride = max(1, len(train) // 8)  # an evenly spaced subset of stats_utterances (TINY: 8)
    mean, std = feature_stats([(r["id"], LogMel(16000, 80)(load_audio(r["path"], 16000))) for r in train.select(range(0, len(train), stride))])
    assert torch.allclose(weights["feat_mean"], mean) and torch.allclose(weights["feat_std"], std)


@pytest.mark.accelerate_launch
@pytest.mark.slow
def test_interrupted_equals_continuous_2proc(tiny_corpus, tmp_path):
    """2 DDP processes, BPE tokens, accumulation 2, encoder frozen for the first 3 steps; cut at step 2."""
    extra = ["--max_steps", "6", "--save_steps", "1", "--eval_steps", "0", "--token_type", "bpe",
             "--bpe_vocab_size", "60", "--gradient_accumulation_steps", "2", "--freeze_encoder_steps", "3",
             "--speed_perturb", "0.1", "--ema_decay", "0.99"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("asr", 2, args_for(tiny_corpus, cont, *extra), launcher=False)  # the reference: forked (the guarantee is the cut run's)
    run("asr", 2, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=2, launcher=False)  # harness.KILL_LEG
    run("asr", 2, args_for(tiny_corpus, cut, *extra))

    assert len(resumed_positions(tmp_path / "interrupted.log")) == 1
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    assert (cont / "final" / "tokenizer" / "bpe.model").read_bytes() == (cut / "tokenizer" / "bpe.model").read_bytes()


@pytest.mark.slow
def test_transfer_script_trains_the_base_once_then_the_voice_from_it(tiny_corpus, tmp_path):
    """recipes/asr/transfer.sh: stage 1 (the built-in ASR run into BASE), stage 2 (the voice,
    --init_from BASE); run again, it skips stage 1 and stage 2's finished run is left as it was; no
    folder or no argument is refused with the usage. Tiny sizes through BASE_ARGS (the tiny corpus
    stands in for the built-in one) and the voice's arguments; `accelerate launch` stands in as
    a forked `python` (harness.accelerate_stand_in; the script's launcher is not what is tested here)."""
    from tests.harness.harness import accelerate_stand_in, cpu_tokens, on_cores

    shim = accelerate_stand_in(tmp_path)
    base, out, voice = tmp_path / "base", tmp_path / "voice", tiny_corpus / "librispeech"
    env = {**os.environ, "ACCELERATE": str(shim), "BASE": str(base), "OUT": str(out),
           "BASE_ARGS": " ".join([*TINY, "--data_dir", str(voice), "--max_steps", "2", "--save_steps", "2",
                                  "--eval_steps", "0"]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def transfer(*args: str) -> subprocess.CompletedProcess:
        with cpu_tokens(1) as cpus:
            return subprocess.run(["bash", str(RECIPE / "transfer.sh"), *args], env=env, capture_output=True,
                                  text=True, timeout=600, preexec_fn=on_cores(cpus))

    from_scratch = TINY.index("--init_from")
    voice_args = [str(voice), *TINY[:from_scratch], *TINY[from_scratch + 2 :], "--max_steps", "2", "--save_steps", "2",
                  "--eval_steps", "0"]  # the script's --init_from BASE, not TINY's none
    first = transfer(*voice_args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "1/2 ASR on the built-in corpus" in first.stdout and "2/2" in first.stdout
    assert (base / "final" / "COMPLETE").is_file() and (out / "final" / "COMPLETE").is_file()
    assert f"initialized from {base}" in first.stdout + first.stderr
    assert yaml.safe_load((out / "final" / "config.yaml").read_text())["init_from"] == str(base)
    weights = (out / "final" / "model.safetensors").read_bytes()

    again = transfer(*voice_args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "1/2" not in again.stdout and "2/2" in again.stdout
    assert (out / "final" / "model.safetensors").read_bytes() == weights

    for args, says in (((), "usage: bash recipes/asr/transfer.sh DATA_DIR"), ((str(tmp_path / "nowhere"),), "is not a folder")):
        refused = transfer(*args)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr


@pytest.mark.slow
def test_init_from_builtin_starts_a_voice_from_the_base_trained_once(tiny_corpus, tmp_path):
    """--init_from builtin (config.yaml's default): the first voice trains the base (a child run on the
    built-in corpus with the voice's encoder shape, into the corpus cache) and starts from its encoder
    and feature statistics; a second voice reuses it, whatever its thread count, and so does a third
    that finds the same cache through $SPEECH_RECIPES_CACHE; a resumed voice does not need it; on the
    built-in corpus itself it means from scratch."""
    cache = tiny_corpus.parent  # the corpus cache (the base's name holds this test's YAML path: its own)
    base_yaml = tmp_path / "base.yaml"
    base_yaml.write_text("max_steps: 3\nwarmup_steps: 5\nmax_batch_seconds: 16\nstats_utterances: 20\n"
                         "save_steps: 2\nlogging_steps: 1\neval_steps: 0\n")

    def voice(out: Path, *extra: str):
        return run("asr", 1, args_for(tiny_corpus, out, "--max_steps", "2", "--save_steps", "2", "--eval_steps", "0",
                                      "--init_from", "builtin", "--builtin_corpus", "tiny", "--base_config",
                                      str(base_yaml), "--data_cache_dir", str(cache), *extra))

    first = voice(tmp_path / "voice1")
    assert first.count("training it once for this machine") == 1
    base = Path(re.search(r"encoder: \S+ M parameters, initialized from (\S+)", first).group(1))
    assert base.parent == cache and base.name.startswith("asr_base-")
    trained = yaml.safe_load((base / "final" / "config.yaml").read_text())
    assert (trained["data_dir"], trained["init_from"], trained["hidden_size"], trained["max_steps"]) == (None, None, 32, 3)
    stats = lambda run_dir: json.loads((run_dir / "final" / "preprocessor_config.json").read_text())["mean"]  # noqa: E731
    assert stats(tmp_path / "voice1") == stats(base)  # the base's feature statistics, not the voice's
    assert yaml.safe_load((tmp_path / "voice1" / "final" / "config.yaml").read_text())["init_from"] == "builtin"

    second = voice(tmp_path / "voice2", "--num_threads", "1")  # another thread count: the same base (the machine's)
    assert "training it once" not in second and f"initialized from {base}" in second
    unnamed = args_for(tiny_corpus, tmp_path / "voice3", "--max_steps", "1", "--eval_steps", "0", "--init_from", "builtin",
                       "--builtin_corpus", "tiny", "--base_config", str(base_yaml))
    third = run("asr", 1, unnamed, env={"SPEECH_RECIPES_CACHE": str(cache)})  # the same cache, not named: the same base
    assert "training it once" not in third and f"initialized from {base}" in third
    shutil.rmtree(base)  # a resumed voice has its start in its checkpoint: it neither needs nor retrains the base
    resumed = voice(tmp_path / "voice2", "--max_steps", "3")
    assert "training it once" not in resumed and "resumed" in resumed and not base.exists()

    itself = run("asr", 1, [*TINY, "--init_from", "builtin", "--max_steps", "1", "--eval_steps", "0",
                            "--output_dir", str(tmp_path / "builtin"), "--builtin_corpus", "tiny",
                            "--data_cache_dir", str(cache)])
    assert "the base of other voices" in itself and "training it once" not in itself


@pytest.mark.slow
def test_init_from_best_rq_freeze_and_evaluate(tiny_corpus, tmp_path):
    """A tiny BEST-RQ run initializes the ASR encoder and its feature statistics; the encoder stays
    frozen for freeze_encoder_steps in 2 DDP processes; a mismatched encoder is refused; decode.py
    in 2 processes scores each test utterance exactly once."""
    brq = tmp_path / "best_rq"
    run("best_rq", 1, ["--data_dir", str(tiny_corpus / "librispeech"), "--output_dir", str(brq), *ENCODER,
                       "--codebook_size", "64", "--max_steps", "4", "--warmup_steps", "2", "--save_steps", "4",
                       "--eval_steps", "0", "--report_to", "none", "--max_batch_seconds", "16", "--stats_utterances", "20"])
    pre = load_file(brq / "final" / "model.safetensors")

    asr_out = tmp_path / "asr"
    run("asr", 2, args_for(tiny_corpus, asr_out, "--init_from", str(brq), "--freeze_encoder_steps", "2",
                           "--encoder_lr_scale", "0.5", "--max_steps", "4", "--save_steps", "1",
                           "--save_total_limit", "10", "--eval_steps", "0"))
    assert "initialized from" in (tmp_path / "asr.log").read_text()
    step = {s: load_file(asr_out / "checkpoints" / f"step_{s:08d}" / "model.safetensors") for s in (1, 2, 3)}
    enc_keys = [k for k in pre if k.startswith("encoder.")]
    for s in (1, 2):  # frozen: bit-identical to pre-training
        assert all(torch.equal(step[s][k], pre[k]) for k in enc_keys)
    assert not all(torch.equal(step[3][k], pre[k]) for k in enc_keys)  # unfrozen at step 3
    assert not torch.equal(step[1]["head.weight"], step[2]["head.weight"])  # the head trains meanwhile
    final = load_recipe_ctc_weights(asr_out / "final")
    for k in ("feat_mean", "feat_std"):  # BEST-RQ's statistics, not recomputed
        assert torch.equal(final[k], pre[k])

    bad = launch("train.py", 1, args_for(tiny_corpus, tmp_path / "bad", "--init_from", str(brq / "final"),
                                         "--hidden_size", "48", "--stack_frames", "2"), tmp_path / "bad.log")
    assert bad.returncode != 0
    assert "does not match" in bad.stdout and "hidden_size: pre-trained 32 != this run 48" in bad.stdout
    assert "stack_frames: pre-trained 4 != this run 2" in bad.stdout

    # Transfer: an ASR run's final/ starts another ASR run with its Conformer and statistics (the CTC
    # head, whose vocabulary may differ, starts fresh).
    xfer = tmp_path / "xfer"
    run("asr", 1, args_for(tiny_corpus, xfer, "--init_from", str(asr_out), "--freeze_encoder_steps", "1",
                           "--max_steps", "2", "--save_steps", "1", "--eval_steps", "0"))
    got = load_file(xfer / "checkpoints" / "step_00000001" / "model.safetensors")
    assert all(torch.equal(got[k], final[k]) for k in (*enc_keys, "feat_mean", "feat_std"))
    assert not torch.equal(got["head.weight"], final["head.weight"])

    ev = launch("decode.py", 2, ["--checkpoint", str(asr_out), "--split", "test", "--decoding", "beam",
                                   "--beam_size", "4", "--max_batch_seconds", "8"], tmp_path / "eval.log")
    assert ev.returncode == 0, ev.stdout[-3000:]
    assert re.search(r"WER \d+\.\d\d%  CER \d+\.\d\d%", ev.stdout)
    test_ids = read_librispeech(tiny_corpus / "librispeech", "test")["id"]
    rows = [json.loads(line) for line in (asr_out / "decode" / "final" / "test-beam.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == sorted(test_ids)  # each test utterance exactly once
    summary = json.loads((asr_out / "decode" / "final" / "test-beam.json").read_text())
    assert summary["utterances"] == len(test_ids) and summary["processes"] == 2
    hyps, refs = [r["hyp"] for r in rows], [r["ref"] for r in rows]
    assert summary["cer"] == pytest.approx(jiwer.cer(refs, hyps))


def assert_decode_report(name: Path, audio: dict[str, str]) -> None:
    """decode.py's <name>.html shows <name>.json's figures, and per utterance of <name>.jsonl its
    hypothesis, the reference's errors marked, its WER and CER, and its audio (`audio`: id → the
    data's file) beside the page."""
    from tests.tools.test_report import read_page

    shown, page = read_page(name.with_suffix(".html"))
    summary = json.loads(name.with_suffix(".json").read_text())
    assert {k: float(shown[k]) for k in ("wer", "cer")} == pytest.approx({k: summary[k] for k in ("wer", "cer")}, rel=1e-3)
    assert shown["utterances"] == str(summary["utterances"]) and "decode.py" in name.with_suffix(".html").read_text()
    jsonl = [json.loads(line) for line in name.with_suffix(".jsonl").read_text().splitlines()]
    assert [(r["id"], r["ref"], r["hyp"]) for r in page["rows"]] == [(r["id"], r["ref"], r["hyp"]) for r in jsonl]
    for row in page["rows"]:
        assert row["wer"] == pytest.approx(jiwer.wer(row["ref"], row["hyp"]))
        assert row["cer"] == pytest.approx(jiwer.cer(row["ref"], row["hyp"]))
        assert " ".join(r for _, r, _ in row["edits"] if r) == " ".join(row["ref"].split())  # the marks spell both
        assert " ".join(h for _, _, h in row["edits"] if h) == " ".join(row["hyp"].split())
        assert (name.parent / row["audio"]).read_bytes() == Path(audio[row["id"]]).read_bytes()
    assert page["sort"] == "wer"


@pytest.mark.slow
def test_transcribe_files_as_decode_py_does(tiny_corpus, tmp_path, reference):
    """transcribe.py --audio: each test utterance gets decode.py's greedy text; a stereo float copy of
    one (equal channels) reads as the file itself, a 22.05 kHz file is resampled; --output holds what
    is printed; --lm decodes with the LM. (Files it refuses: tests/common/data/test_data.py.)"""
    import numpy as np
    import soundfile as sf

    out = short_run(reference, tiny_corpus, tmp_path / "asr")
    test = read_librispeech(tiny_corpus / "librispeech", "test")
    mono, rate = sf.read(test[0]["path"], dtype="float32")
    sf.write(tmp_path / "stereo.wav", np.stack([mono, mono], axis=1), rate, subtype="FLOAT")
    lj = sorted((tiny_corpus / "ljspeech" / "wavs").glob("*.wav"))[0]  # 22.05 kHz
    files = [*test["path"], str(tmp_path / "stereo.wav"), str(lj)]
    proc = launch("transcribe.py", 1, ["--checkpoint", str(out), "--audio", *files, "--output",
                                       str(tmp_path / "t.jsonl")], tmp_path / "transcribe.log")
    assert proc.returncode == 0, proc.stdout[-3000:]
    printed = [line.split("\t") for line in proc.stdout.splitlines() if "\t" in line]
    assert [p for p, _ in printed] == files
    assert [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()] == [
        {"path": p, "text": t} for p, t in printed]
    assert launch("decode.py", 1, ["--checkpoint", str(out), "--split", "test", "--data_dir",
                                   str(tiny_corpus / "librispeech")], tmp_path / "decode.log").returncode == 0
    decoded = {r["id"]: r["hyp"] for r in map(json.loads, (out / "decode" / "final" / "test-greedy.jsonl").read_text().splitlines())}
    assert [t for _, t in printed[: len(test)]] == [decoded[i] for i in test["id"]]
    assert_decode_report(out / "decode" / "final" / "test-greedy", dict(zip(test["id"], test["path"])))
    assert printed[len(test)][1] == printed[0][1]  # the stereo copy

    if importlib.util.find_spec("kenlm") and importlib.util.find_spec("pyctcdecode"):
        lm = recipe_modules("asr", "lm").lm
        lm.write_lm_folder([t.lower() for t in test["text"]], tmp_path / "lm", order=2)
        with_lm = launch("transcribe.py", 1, ["--checkpoint", str(out), "--audio", *test["path"], "--lm",
                                              str(tmp_path / "lm")], tmp_path / "lm.log")
        assert with_lm.returncode == 0, with_lm.stdout[-3000:]
        assert [line.split("\t")[0] for line in with_lm.stdout.splitlines() if "\t" in line] == list(test["path"])
