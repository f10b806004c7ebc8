"""A word n-gram language model of the training transcripts, in ARPA form, for beam search with
shallow fusion (decode.py --lm, and final/language_model/ for transformers' pipeline).

    python recipes/asr/lm.py --checkpoint outputs/asr --order 3 --output_dir outputs/asr/lm

--checkpoint is a training output_dir, its final/, or a checkpoints/step_XXXXXXXX/ folder: the LM is
built from that run's training transcripts (its data_dir, train_split, train_fraction), normalized by
its tokenizer exactly as the CTC targets were. The output folder holds pyctcdecode's layout:
`lm.arpa`, `unigrams.txt` (the known words) and `attrs.json` (alpha: LM weight, beta: bonus per word,
unk_score_offset: log10 penalty of an unknown word), sealed like every output here by a `COMPLETE`
marker (each file's size and SHA-256) that decode.py and export.py check before reading it. It is
written into `.<name>.tmp/` and renamed when sealed. (pyctcdecode's own `LanguageModel.load_from_dir`
wants exactly three files: give it the export's `language_model/`, which export.py --lm writes.)

Interpolated modified Kneser-Ney (Chen & Goodman 1998, as KenLM's lmplz estimates it): the highest
order keeps raw counts; a lower-order n-gram counts the distinct words seen before it (its
continuation count), except an n-gram starting with <s>, which nothing precedes (raw count). Each
order has three discounts D1, D2, D3+ from its counts of counts n1..n4:
Y = n1/(n1+2 n2), D1 = 1-2Y n2/n1, D2 = 2-3Y n3/n2, D3+ = 3-4Y n4/n3. When a tiny corpus leaves a
count of counts at zero or a discount outside (0, k), that order uses 0.5, 1.0, 1.5 (lmplz's
--discount_fallback). For a context h (total adjusted count T) and a word w:

    p(w | h) = (a(h w) - D(a(h w))) / T + gamma(h) p(w | h minus its first word)
    gamma(h) = (D1 N1(h) + D2 N2(h) + D3+ N3+(h)) / T     (N_k(h): words after h with count k)

and unigrams interpolate with the uniform distribution over the vocabulary (</s> and <unk> included,
<s> never predicted). In ARPA a seen n-gram stores log10 p(w | h) and a context stores log10 gamma(h)
as its backoff, so every conditional distribution sums to 1 (tests/recipes/test_lm.py checks it
through kenlm).

Built with our own writer because KenLM's lmplz needs Boost and a CMake build; reading the ARPA at
decode time needs the `kenlm` Python module (requirements-lm.txt).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.config_rules import ExistingPath, Range

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
FALLBACK_DISCOUNTS = (0.5, 1.0, 1.5)  # lmplz --discount_fallback
# pyctcdecode's defaults; decode.py --tune_lm picks better ones on the validation split.
DEFAULT_ATTRS = {"alpha": 0.5, "beta": 1.5, "unk_score_offset": -10.0, "score_boundary": True}


def count_ngrams(sentences: list[list[str]], order: int) -> list[Counter]:
    """counts[k-1][(w1..wk)]: raw counts of every k-gram, k = 1..order, in "<s> words </s>"."""
    counts = [Counter() for _ in range(order)]
    for words in sentences:
        padded = [BOS, *words, EOS]
        for k in range(1, order + 1):
            for i in range(len(padded) - k + 1):
                counts[k - 1][tuple(padded[i: i + k])] += 1
    del counts[0][(BOS,)]  # <s> is a context, never a predicted word
    return counts


def adjusted_counts(counts: list[Counter]) -> list[Counter]:
    """Raw counts at the highest order (and for n-grams starting with <s>); continuation counts below."""
    adjusted = [Counter() for _ in counts]
    adjusted[-1] = Counter(counts[-1])
    for k in range(len(counts) - 1):
        left = Counter(g[1:] for g in counts[k + 1])  # distinct words before each k+1-gram suffix
        for g, c in counts[k].items():
            adjusted[k][g] = c if g[0] == BOS else left[g]
    return adjusted


def discounts(adjusted: Counter) -> tuple[float, float, float]:
    """(D1, D2, D3+) of one order from its counts of counts; the fallback when they are degenerate."""
    n = Counter(min(c, 4) for c in adjusted.values())
    n1, n2, n3, n4 = (n[i] for i in (1, 2, 3, 4))
    if min(n1, n2, n3, n4) == 0:
        return FALLBACK_DISCOUNTS
    y = n1 / (n1 + 2 * n2)
    d = (1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3)
    return d if all(0 < di < i for i, di in enumerate(d, 1)) else FALLBACK_DISCOUNTS


def estimate(sentences: list[list[str]], order: int) -> list[dict[tuple[str, ...], tuple[float, float | None]]]:
    """Modified Kneser-Ney: model[k-1][(w1..wk)] = (log10 p(wk | w1..wk-1), log10 backoff or None)."""
    if order < 2:
        raise ValueError(f"order must be ≥ 2 (kenlm reads bigram models and up), got {order}")
    if not any(sentences):
        raise ValueError("no words to build a language model from")
    adjusted = adjusted_counts(count_ngrams(sentences, order))
    prob: list[dict[tuple[str, ...], float]] = []  # interpolated p(w | h), linear
    gamma: list[dict[tuple[str, ...], float]] = [dict() for _ in range(order)]  # gamma[k][h], len(h) == k
    vocab = 1 + len(adjusted[0])  # <unk> + every word seen (</s> included, <s> not)
    for k in range(order):
        d = discounts(adjusted[k])
        by_context: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
        for g, c in adjusted[k].items():
            by_context[g[:-1]].append((g[-1], c))
        p_k = {}
        for h, followers in by_context.items():
            total = sum(c for _, c in followers)
            kept = Counter(min(c, 3) for _, c in followers)
            g_h = sum(d[i - 1] * kept[i] for i in (1, 2, 3)) / total
            gamma[k][h] = g_h
            for w, c in followers:
                lower = 1.0 / vocab if k == 0 else prob[k - 1][h[1:] + (w,)]
                p_k[h + (w,)] = (c - d[min(c, 3) - 1]) / total + g_h * lower
        prob.append(p_k)
    model = []
    for k in range(order):
        bo = gamma[k + 1] if k + 1 < order else {}
        model.append({g: (math.log10(p), math.log10(bo[g]) if g in bo else None) for g, p in prob[k].items()})
    model[0][(UNK,)] = (math.log10(gamma[0][()] / vocab), None)
    model[0][(BOS,)] = (-99.0, math.log10(gamma[1][(BOS,)]) if order > 1 else None)  # ARPA's "never predicted"
    return model


def write_arpa(model, path: str | Path) -> None:
    lines = ["", "\\data\\", *(f"ngram {k + 1}={len(m)}" for k, m in enumerate(model)), ""]
    for k, m in enumerate(model):
        lines.append(f"\\{k + 1}-grams:")
        for g in sorted(m):
            logp, bo = m[g]
            lines.append(f"{logp:.7f}\t{' '.join(g)}" + ("" if bo is None else f"\t{bo:.7f}"))
        lines.append("")
    lines.append("\\end\\")
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_lm_folder(texts: list[str], folder: str | Path, order: int = 3, attrs: dict | None = None) -> Path:
    """`folder/{lm.arpa, unigrams.txt, attrs.json}` (pyctcdecode's layout) from normalized `texts`, sealed
    last with a COMPLETE marker (every file's size and digest) like every folder a tool reads:
    decode.py and export.py check it before kenlm opens anything."""
    from common.training.sealing import seal_export

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sentences = [t.split() for t in texts if t.split()]
    write_arpa(estimate(sentences, order), folder / "lm.arpa")
    words = sorted({w for s in sentences for w in s})
    (folder / "unigrams.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    (folder / "attrs.json").write_text(json.dumps({**DEFAULT_ATTRS, **(attrs or {})}) + "\n")
    seal_export(folder)
    return folder


@dataclass
class LmConfig:
    """Build a word n-gram LM from a run's training transcripts. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/asr"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    data_dir: Annotated[str | None, ExistingPath] = None  # None: the checkpoint's data_dir (or its built-in corpus)
    order: Annotated[int, Range(2)] = 3  # n of the n-grams (3: trigrams; kenlm reads 2 and up)
    output_dir: str = "lm"  # the folder to write (must not exist yet)


def main():
    from common.training.sealing import resolve_checkpoint
    from common.config import load_config, parse_config
    from tools.corpus import resolve_data_dir

    from data import labelled_subset, read_split  # recipe-local (this folder is on sys.path)
    from text import checkpoint_tokenizer
    from train import Config

    args = parse_config(LmConfig)
    out = Path(args.output_dir)
    if out.exists():
        raise SystemExit(f"error: --output_dir {out} exists; choose a new folder")
    folder = resolve_checkpoint(args.checkpoint)
    cfg = load_config(folder, Config)
    tokenizer = checkpoint_tokenizer(folder)
    data_dir = args.data_dir or resolve_data_dir(cfg.data_dir, cfg.data_cache_dir, cfg.builtin_corpus, "librispeech")
    train = labelled_subset(read_split(data_dir, cfg.train_split), cfg.train_fraction)
    # Written aside, then renamed: a kill leaves .<name>.tmp/, never an unsealed --output_dir
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_lm_folder([tokenizer.normalize(t) for t in train["text"]], tmp, args.order)
    os.rename(tmp, out)
    sizes = [line for line in (out / "lm.arpa").read_text().splitlines()[:args.order + 2] if line.startswith("ngram")]
    print(f"{out}: {args.order}-gram LM of {len(train)} training transcripts ({', '.join(sizes)})")


if __name__ == "__main__":
    from common.training.faults import run_main

    run_main(main)  # a refused --checkpoint (common.training.sealing.resolve_checkpoint): one line, exit code 2
