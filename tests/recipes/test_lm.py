"""The word n-gram LM (recipes/asr/lm.py) and decoding with it: the ARPA is modified Kneser-Ney (by-hand
values, every distribution sums to 1 through kenlm), decode.py --lm scores with and without it, and
the export makes transformers' pipeline decode with it."""

from __future__ import annotations

import json
import math
import random
import sys

import numpy as np
import pytest
import soundfile as sf

from common.data.manifest import read_librispeech
from tests.harness.recipe_import import recipe_modules
from tests.recipes.test_asr import launch, short_run

kenlm = pytest.importorskip("kenlm", reason="pip install -r requirements-lm.txt")
asr = recipe_modules("asr", "lm", "ctc_decode", "text")
lm = asr.lm


def query(model, words: list[str]) -> float:
    """log10 p(</s> | ...) + Σ log10 p(w | history) of one sentence, state by state."""
    state, total = kenlm.State(), 0.0
    model.BeginSentenceWrite(state)
    for w in [*words, "</s>"]:
        out = kenlm.State()
        total += model.BaseScore(state, w, out)
        state = out
    return total


def test_kneser_ney_by_hand(tmp_path):
    """"a b" and "a": continuation counts a=1 b=1 </s>=2; the tiny counts of counts take the fallback
    discounts 0.5, 1, 1.5; gamma(()) = (0.5·2 + 1·1)/4 = 0.5 over a vocabulary of 4 (a b </s> <unk>)."""
    lm.write_lm_folder(["a b", "a"], tmp_path, order=2)
    model = kenlm.Model(str(tmp_path / "lm.arpa"))
    p = {"a": 0.5 / 4 + 0.5 / 4, "b": 0.5 / 4 + 0.5 / 4, "</s>": 1 / 4 + 0.5 / 4, "<unk>": 0.5 / 4}
    assert sum(p.values()) == pytest.approx(1.0)
    p_a_bos = (2 - 1) / 2 + 0.5 * p["a"]  # <s> a: raw count 2, D2 = 1, gamma(<s>) = 1·1/2
    p_b_a = (1 - 0.5) / 2 + 0.5 * p["b"]  # a b, a </s>: gamma(a) = 0.5·2/2
    p_eos_b = (1 - 0.5) / 1 + 0.5 * p["</s>"]
    assert query(model, ["a", "b"]) == pytest.approx(math.log10(p_a_bos * p_b_a * p_eos_b), abs=1e-6)
    # "b b": b after <s> and b after b were never seen: the backoffs times the unigrams
    p_b_b = 0.5 * p["b"]
    assert query(model, ["b", "b"]) == pytest.approx(math.log10(0.5 * p["b"] * p_b_b * p_eos_b), abs=1e-6)
    assert query(model, ["zzz"]) == pytest.approx(math.log10(0.5 * p["<unk>"] * p["</s>"]), abs=1e-6)
    assert (tmp_path / "unigrams.txt").read_text().split() == ["a", "b"]


def test_modified_discounts_from_counts_of_counts():
    counts = {("w", str(i)): c for i, c in enumerate([1, 1, 1, 1, 2, 2, 3, 7])}  # n1=4 n2=2 n3=1 n4+=1
    y = 4 / (4 + 2 * 2)
    assert lm.discounts(counts) == pytest.approx((1 - 2 * y * 2 / 4, 2 - 3 * y * 1 / 2, 3 - 4 * y * 1 / 1))
    counts[("w", "x")] = 4  # n4 = 2: D3+ = 3 - 4·0.5·2 < 0
    assert lm.discounts(counts) == lm.FALLBACK_DISCOUNTS
    assert lm.discounts({("w",): 1}) == lm.FALLBACK_DISCOUNTS  # no count of 2, 3, 4


@pytest.mark.parametrize("order", [2, 3, 4])
def test_every_distribution_sums_to_one_in_kenlm(tmp_path, order):
    rng = random.Random(order)
    words = "the cat a dog sat on mat ran to it".split()
    texts = [" ".join(rng.choice(words[: rng.randint(2, 10)]) for _ in range(rng.randint(1, 9))) for _ in range(300)]
    lm.write_lm_folder(texts, tmp_path, order=order)
    model = kenlm.Model(str(tmp_path / "lm.arpa"))
    assert model.order == order
    vocab = [*words, "</s>", "<unk>"]
    histories = [[], ["the"], ["the", "cat"], ["cat", "cat", "cat"], ["mat", "it", "to"], ["unseen", "word"]]
    for history in histories:
        state = kenlm.State()
        model.BeginSentenceWrite(state)
        for w in history:
            out = kenlm.State()
            model.BaseScore(state, w, out)
            state = out
        total = sum(10 ** model.BaseScore(state, w, kenlm.State()) for w in vocab)
        assert total == pytest.approx(1.0, abs=1e-5), history


def test_refusals(tmp_path, monkeypatch):
    from common.training.sealing import seal_export

    tok = asr.text.CharTokenizer()
    (tmp_path / "empty").mkdir()
    seal_export(tmp_path / "empty")
    with pytest.raises(asr.ctc_decode.LmError, match="expected one .arpa/.bin file and unigrams.txt"):
        asr.ctc_decode.load_lm_decoder(tmp_path / "empty", tok)
    (tmp_path / "words.txt").write_text("a b\n")
    with pytest.raises(asr.ctc_decode.LmError, match="not an LM folder from lm.py nor an .arpa/.bin file"):
        asr.ctc_decode.load_lm_decoder(tmp_path / "words.txt", tok)
    (tmp_path / "broken.arpa").write_text("not an arpa\n")
    with pytest.raises(asr.ctc_decode.LmError, match="kenlm cannot read it"):
        asr.ctc_decode.load_lm_decoder(tmp_path / "broken.arpa", tok)
    monkeypatch.setitem(sys.modules, "kenlm", None)  # as if not installed
    with pytest.raises(asr.ctc_decode.LmError, match="pip install -r requirements-lm.txt"):
        asr.ctc_decode.load_lm_decoder(tmp_path / "broken.arpa", tok)
    with pytest.raises(ValueError, match="no words"):
        lm.write_lm_folder(["", " "], tmp_path / "none")


def test_an_lm_is_checked_before_kenlm_opens_it(tmp_path):
    """lm.py's folder is sealed: a changed, unsealed or added file is refused in one line saying how to
    get a good one, and so is a FIFO in it or given as a bare .arpa (kenlm would block on it for ever),
    before anything opens it. An export's language_model/ is checked against the export's marker."""
    import os
    import shutil

    from common.training.sealing import MARKER, seal_export

    tok = asr.text.CharTokenizer()
    folder = lm.write_lm_folder(["a b", "a"], tmp_path / "lm", order=2)
    assert (folder / MARKER).is_file()
    asr.ctc_decode.load_lm_decoder(folder, tok)

    def refused(path, *says):
        with pytest.raises(asr.ctc_decode.LmError) as e:
            asr.ctc_decode.load_lm_decoder(path, tok)
        assert "\n" not in str(e.value) and all(s in str(e.value) for s in says), str(e.value)

    arpa = (folder / "lm.arpa").read_text()
    (folder / "lm.arpa").unlink()
    os.mkfifo(folder / "lm.arpa")  # never opened: the check uses stat alone
    refused(folder, f"{folder}: lm.arpa is a FIFO (named pipe), not a regular file", "re-run lm.py")
    (folder / "lm.arpa").unlink()
    (folder / "lm.arpa").write_text(arpa.replace("-0.", "-1."))
    refused(folder, f"{folder}: damaged (lm.arpa is corrupted (digest mismatch)): re-run lm.py")
    (folder / "lm.arpa").write_text(arpa)
    asr.ctc_decode.load_lm_decoder(folder, tok)
    (folder / MARKER).unlink()
    refused(folder, "no COMPLETE marker", "re-run lm.py to write it again")
    os.mkfifo(tmp_path / "pipe.arpa")
    refused(tmp_path / "pipe.arpa", f"{tmp_path / 'pipe.arpa'} is a FIFO (named pipe), not a regular file: give an")
    export = tmp_path / "export"
    shutil.copytree(folder, export / "language_model")
    seal_export(export)  # as export.py seals its folder, language_model/ with it
    asr.ctc_decode.load_lm_decoder(export / "language_model", tok)
    (export / "language_model" / "unigrams.txt").write_text("z\n")
    refused(export / "language_model", f"{export}: damaged (language_model/unigrams.txt has 2 bytes")


def test_bpe_pieces_decode_with_the_lm(tmp_path):
    """pyctcdecode reads SentencePiece's "▁" as a word start: the LM scores whole words of BPE output."""
    texts = ["the cat sat", "the dog sat", "a cat ran", "the cat ran to the mat"] * 5
    tok = asr.text.train_bpe(texts, tmp_path, vocab_size=30)
    lm.write_lm_folder(texts, tmp_path / "lm", order=3)
    decoder = asr.ctc_decode.load_lm_decoder(tmp_path / "lm", tok)
    ids = tok.encode("the cat sat")
    log_probs = np.full((2 * len(ids) + 1, tok.vocab_size), -8.0, dtype=np.float32)
    log_probs[::2, 0] = 0.0  # blank, token, blank, token ... blank
    for t, i in enumerate(ids):
        log_probs[2 * t + 1, i] = 0.0
    assert asr.ctc_decode.lm_decode(decoder, log_probs, beam_width=16) == "the cat sat"


@pytest.mark.slow
def test_decode_and_pipeline_with_the_lm(tiny_corpus, tmp_path, reference):
    """A short training run → lm.py → decode.py --lm --tune_lm (tuned on the validation split; WER with
    and without the LM, the greedy side equal to decode.py greedy) → export.py --lm → transformers'
    pipeline decodes with pyctcdecode and the LM, the same text as decode.py for every test utterance."""
    from transformers import pipeline

    out, data = tmp_path / "asr", tiny_corpus / "librispeech"
    short_run(reference, tiny_corpus, out)
    proc = launch("lm.py", 1, ["--checkpoint", str(out), "--order", "3", "--output_dir", str(tmp_path / "lm")], tmp_path / "lm.log")
    assert proc.returncode == 0, proc.stdout
    assert kenlm.Model(str(tmp_path / "lm" / "lm.arpa")).order == 3

    common = ["--checkpoint", str(out), "--split", "test", "--data_dir", str(data)]
    proc = launch("decode.py", 1, [*common, "--lm", str(tmp_path / "lm"), "--tune_lm", "--lm_alphas", "0.5,2",
                                   "--lm_betas", "0,1"], tmp_path / "decode.log")
    assert proc.returncode == 0, proc.stdout
    assert "alpha 2.0 beta 1.0: WER" in proc.stdout and "without the LM (greedy): WER" in proc.stdout
    summary = json.loads((out / "decode" / "final" / "test-lm.json").read_text())
    assert summary["tuned_on"] == "validation" and summary["lm_alpha"] in (0.5, 2) and summary["lm_beta"] in (0, 1)
    proc = launch("decode.py", 1, common, tmp_path / "greedy.log")
    assert proc.returncode == 0, proc.stdout
    greedy = json.loads((out / "decode" / "final" / "test-greedy.json").read_text())
    assert (summary["wer_no_lm"], summary["cer_no_lm"]) == (greedy["wer"], greedy["cer"])
    ours = {r["id"]: r["hyp"] for r in map(json.loads, (out / "decode" / "final" / "test-lm.jsonl").read_text().splitlines())}

    export = tmp_path / "export"
    proc = launch("export.py", 1, ["--checkpoint", str(out), "--output_dir", str(export), "--lm", str(tmp_path / "lm"),
                                   "--lm_alpha", str(summary["lm_alpha"]), "--lm_beta", str(summary["lm_beta"])],
                  tmp_path / "export.log")
    assert proc.returncode == 0, proc.stdout
    from common.training.sealing import resolve_checkpoint

    assert resolve_checkpoint(export) == export  # sealed like a training final/: the tools accept it
    asr_pipe = pipeline("automatic-speech-recognition", model=str(export), trust_remote_code=True)
    assert asr_pipe.type == "ctc_with_lm"
    theirs = {row["id"]: asr_pipe({"raw": sf.read(row["path"], dtype="float32")[0], "sampling_rate": 16000})["text"]
              for row in read_librispeech(data, "test")}
    assert theirs == ours


@pytest.mark.slow
def test_lm_settings_that_cannot_work_are_refused(tiny_corpus, tmp_path, reference):
    out = short_run(reference, tiny_corpus, tmp_path / "asr")
    common = ["--checkpoint", str(out), "--split", "test", "--data_dir", str(tiny_corpus / "librispeech")]
    (tmp_path / "empty").mkdir()
    for extra, says in ((["--tune_lm"], "give the LM with --lm DIR"),
                        (["--lm", str(tmp_path / "missing")], "does not exist"),
                        (["--lm", str(tmp_path / "empty")], "no COMPLETE marker"),
                        (["--lm", str(tmp_path / "empty"), "--decoding", "beam"], "drop --decoding beam")):
        proc = launch("decode.py", 1, [*common, *extra], tmp_path / "refused.log")
        errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stdout  # a usage error: one line, exit 2
        assert len(errors) == 1 and says in errors[0] and proc.stdout.strip().splitlines()[-1] == errors[0], proc.stdout
