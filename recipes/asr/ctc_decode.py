"""CTC decoding: greedy (best path) and prefix beam search (best labelling), no extra dependency.

Both take one utterance's log-posteriors (frames, classes), class 0 the blank, and return token ids.
Greedy picks the most likely class per frame, then merges repeats and drops blanks: it finds the
most likely *path*. A labelling's probability is the sum over all its paths, and prefix beam search
(Hannun et al. 2014, arXiv:1408.2873) keeps the `beam_size` best prefixes with their probability
split into "ends in blank" / "ends in a token", so it can prefer a labelling that many paths share
(see tests/recipes/test_asr.py for a case where greedy is wrong).

`transcribe` decodes a loader with a model (decode.py; model.evaluate adds the validation loss and
WER/CER across processes to it, at train.py's evaluation steps). With a word n-gram LM (lm.py),
`load_lm_decoder` gives pyctcdecode's beam search with shallow fusion (the decoder transformers'
`Wav2Vec2ProcessorWithLM` and ASR pipeline use): score = log p_ctc + alpha · log p_lm + beta · words.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from model import ctc_loss
from text import BLANK

NEG_INF = float("-inf")


def _logaddexp(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def ctc_greedy(log_probs: torch.Tensor) -> list[int]:
    """(frames, classes) → token ids: argmax per frame, repeats merged, blanks removed."""
    best = log_probs.argmax(-1).tolist()
    out, prev = [], BLANK
    for c in best:
        if c != prev and c != BLANK:
            out.append(c)
        prev = c
    return out


def ctc_prefix_beam_search(log_probs: torch.Tensor, beam_size: int = 8) -> list[int]:
    """(frames, classes) → token ids of the most probable labelling found with `beam_size` prefixes.

    At each frame only the `beam_size` most likely classes extend prefixes.
    """
    lp = log_probs.float().tolist()
    k = min(len(lp[0]) if lp else 1, beam_size)
    # prefix (tuple of ids) → [log P(prefix, path ends in blank), log P(prefix, path ends in a token)]
    beams: dict[tuple[int, ...], list[float]] = {(): [0.0, NEG_INF]}
    for row in lp:
        candidates = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:k]
        nxt: dict[tuple[int, ...], list[float]] = {}
        for prefix, (p_b, p_nb) in beams.items():
            p_total = _logaddexp(p_b, p_nb)
            for c in candidates:
                p = row[c]
                if c == BLANK:  # the prefix stays, now ending in blank
                    s = nxt.setdefault(prefix, [NEG_INF, NEG_INF])
                    s[0] = _logaddexp(s[0], p_total + p)
                    continue
                extended = prefix + (c,)
                e = nxt.setdefault(extended, [NEG_INF, NEG_INF])
                if prefix and c == prefix[-1]:
                    # "aa" as a labelling needs a blank between the two a's ...
                    e[1] = _logaddexp(e[1], p_b + p)
                    # ... while a path ending in "a" that emits "a" again stays on prefix "...a"
                    s = nxt.setdefault(prefix, [NEG_INF, NEG_INF])
                    s[1] = _logaddexp(s[1], p_nb + p)
                else:
                    e[1] = _logaddexp(e[1], p_total + p)
        ranked = sorted(nxt.items(), key=lambda kv: _logaddexp(*kv[1]), reverse=True)
        beams = dict(ranked[:beam_size])
    best = max(beams.items(), key=lambda kv: _logaddexp(*kv[1]))
    return list(best[0])


def ctc_decode(log_probs: torch.Tensor, lengths: torch.Tensor, method: str = "greedy",
               beam_size: int = 8) -> list[list[int]]:
    """Batch of (B, frames, classes) log-posteriors with valid `lengths` (B,) → B token-id lists."""
    out = []
    for b in range(log_probs.shape[0]):
        x = log_probs[b, : int(lengths[b])].cpu()
        if method == "greedy":
            out.append(ctc_greedy(x))
        elif method == "beam":
            out.append(ctc_prefix_beam_search(x, beam_size))
        else:
            raise ValueError(f"unknown decoding method {method!r}: 'greedy' or 'beam'")
    return out


@torch.no_grad()
def transcribe(model, loader, tokenizer, decoding: str = "greedy", beam_size: int = 8):
    """Decode this process's share of `loader` → ([(id, hyp, ref)], Σ CTC loss, Σ target tokens)."""
    model.eval()
    results, loss_sum, tokens = [], 0.0, 0
    for batch in loader:
        log_probs, out_lens = model(batch["feats"], batch["feat_lens"])
        n = int(batch["target_lens"].sum())
        loss_sum += ctc_loss(log_probs, out_lens, batch["targets"], batch["target_lens"]).item() * n
        tokens += n
        hyps = ctc_decode(log_probs, out_lens, decoding, beam_size)
        results += [(i, tokenizer.decode(h), r) for i, h, r in zip(batch["ids"], hyps, batch["texts"])]
    model.train()
    return results, loss_sum, tokens


class LmError(ValueError):
    """A language model that cannot be used (missing package, wrong path or file): one line."""


def lm_labels(tokenizer) -> list[str]:
    """pyctcdecode's alphabet, one label per class: "" the blank, then the characters (" " separates
    words) or the SentencePiece pieces ("▁" starts a word; SentencePiece's <unk> becomes pyctcdecode's)."""
    if tokenizer.kind == "char":
        return ["", *tokenizer.vocab[1:]]
    return ["", *(tokenizer.sp.id_to_piece(i) for i in range(tokenizer.sp.get_piece_size()))]


# What an LM folder that fails its seal needs: lm.py writes it again in seconds.
LM_REDO = "re-run lm.py to write it again (a new --output_dir), or copy the whole folder again from where it was made"


def lm_source(path: Path) -> Path:
    """The LM file `path` names, checked before anything opens it: a folder written by lm.py must match
    its COMPLETE marker (`seal_problem`: every file whole, nothing added, only regular files), a
    final/language_model/ its export's; a bare .arpa/.bin file must be a regular file (a FIFO would
    block kenlm for ever; a user's own file has no marker to check). Raises LmError (one line)."""
    from common.training.sealing import MARKER, regular_file_problem, seal_problem

    if path.is_dir():
        # lm.py's folder has its own marker; an export's language_model/ is covered by the export's
        sealed = path.parent if not (path / MARKER).exists() and (path.parent / MARKER).exists() else path
        problem = seal_problem(path, LM_REDO) if sealed == path else seal_problem(sealed)
        if problem:
            raise LmError(f"{sealed}: {problem}")
        files = sorted(p for p in path.iterdir() if p.suffix in (".arpa", ".bin", ".binary"))
        if len(files) != 1 or not (path / "unigrams.txt").is_file():
            raise LmError(f"{path}: expected one .arpa/.bin file and unigrams.txt (a folder from lm.py), found "
                          f"{sorted(p.name for p in path.iterdir())}")
        return files[0]
    if path.suffix not in (".arpa", ".bin", ".binary"):
        raise LmError(f"{path}: not an LM folder from lm.py nor an .arpa/.bin file")
    problem = regular_file_problem(path)
    if problem:
        raise LmError(f"{path} {problem}: give an .arpa/.bin file, or the folder lm.py wrote")
    return path


def load_lm_decoder(path: str | Path, tokenizer, alpha: float | None = None, beta: float | None = None):
    """A pyctcdecode `BeamSearchDecoderCTC` over `tokenizer`'s classes with the LM at `path`: a folder
    written by lm.py (or a final/language_model/), or an .arpa/.bin file (then every 1-gram is a known
    word), checked first (`lm_source`). `alpha`/`beta` None: the folder's attrs.json (pyctcdecode's
    defaults for a bare file)."""
    try:
        import kenlm
        from pyctcdecode import Alphabet, BeamSearchDecoderCTC, LanguageModel
    except ImportError as e:
        raise LmError(f"LM decoding needs pyctcdecode and kenlm ({e}); pip install -r requirements-lm.txt") from None
    path = Path(path)
    lm_file = lm_source(path)
    if lm_file != path:  # a folder, sealed: its unigrams and settings
        unigrams = (path / "unigrams.txt").read_text(encoding="utf-8").split()
        attrs = json.loads((path / "attrs.json").read_text()) if (path / "attrs.json").is_file() else {}
    else:
        unigrams, attrs = None, {}
    try:
        model = kenlm.Model(str(lm_file))
    except (OSError, RuntimeError) as e:
        raise LmError(f"{lm_file}: kenlm cannot read it ({e})") from None
    if unigrams is None:  # a bare ARPA: its 1-grams
        unigrams = _arpa_unigrams(lm_file) if lm_file.suffix == ".arpa" else []
    attrs = {**attrs, **({"alpha": alpha} if alpha is not None else {}), **({"beta": beta} if beta is not None else {})}
    language_model = LanguageModel(model, unigrams, **{k: v for k, v in attrs.items() if k in LanguageModel.JSON_ATTRS})
    return BeamSearchDecoderCTC(Alphabet.build_alphabet(lm_labels(tokenizer)), language_model)


def export_lm(folder: str | Path, lm_dir: str | Path, tokenizer, alpha: float | None = None,
              beta: float | None = None) -> None:
    """Add the LM of `lm_dir` (lm.py's folder) to the transformers export `folder` the way
    `Wav2Vec2ProcessorWithLM` saves one: `alphabet.json`, `language_model/{lm.arpa, unigrams.txt,
    attrs.json}`, and `processor_class` in `preprocessor_config.json`, which is what makes
    `pipeline("automatic-speech-recognition", ...)` decode with pyctcdecode and the LM."""
    folder = Path(folder)
    load_lm_decoder(lm_dir, tokenizer, alpha, beta).save_to_dir(str(folder))  # what the processor's save_pretrained writes
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["processor_class"] = "Wav2Vec2ProcessorWithLM"
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _arpa_unigrams(path: Path) -> list[str]:
    words, inside = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("\\"):
                inside = line.strip() == "\\1-grams:"
                continue
            parts = line.split("\t")
            if inside and len(parts) >= 2 and parts[1].strip() not in ("<s>", "</s>", "<unk>"):
                words.append(parts[1].strip())
    return words


@torch.no_grad()
def posteriors(model, loader) -> list[tuple[str, str, np.ndarray]]:
    """This process's share of `loader` → [(id, ref, (frames, classes) float32 log-posteriors)]."""
    model.eval()
    out = []
    for batch in loader:
        log_probs, out_lens = model(batch["feats"], batch["feat_lens"])
        out += [(i, r, log_probs[b, : int(out_lens[b])].cpu().numpy())
                for b, (i, r) in enumerate(zip(batch["ids"], batch["texts"]))]
    model.train()
    return out


def lm_decode(decoder, log_probs: np.ndarray, beam_width: int) -> str:
    """(frames, classes) log-posteriors → text, single-spaced like the tokenizers' decode."""
    return " ".join(decoder.decode(log_probs, beam_width=beam_width).split())
