"""CTC decoding: greedy (best path) and prefix beam search (best labelling), no extra dependency.

Both take one utterance's log-posteriors (frames, classes), class 0 the blank, and return token ids.
Greedy picks the most likely class per frame, then merges repeats and drops blanks: it finds the
most likely *path*. A labelling's probability is the sum over all its paths, and prefix beam search
(Hannun et al. 2014, arXiv:1408.2873) keeps the `beam_size` best prefixes with their probability
split into "ends in blank" / "ends in a token", so it can prefer a labelling that many paths share
(see tests/recipes/test_asr.py for a case where greedy is wrong).

`transcribe` decodes a loader with a model (decode.py); `evaluate` adds the validation loss and
WER/CER across processes (train.py, at evaluation steps).
"""

from __future__ import annotations

import math

import torch

from model import ctc_loss
from scoring import gather_results
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


def evaluate(model, loader, accelerator, tokenizer, scorer) -> tuple[dict, list[tuple[str, str, str]]]:
    """Validation CTC loss (every rank) and greedy WER/CER (main process), each utterance once, and
    every (id, hypothesis, reference) sorted by id (to show a few). Collective: call on every rank."""
    results, loss_sum, tokens = transcribe(model, loader, tokenizer)
    totals = accelerator.reduce(torch.tensor([loss_sum, tokens], dtype=torch.float64, device=accelerator.device), "sum")
    results = gather_results(results)  # collective
    row = {"eval_loss": (totals[0] / totals[1]).item()}
    if accelerator.is_main_process:  # metric modules run on the main process only
        scores = scorer([h for _, h, _ in results], [r for _, _, r in results])
        row.update(eval_wer=scores["wer"], eval_cer=scores["cer"])
    return row, results
