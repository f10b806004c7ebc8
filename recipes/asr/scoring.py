"""WER and CER through the `evaluate` metric modules shipped in metrics/ (no download), and the
gathering of (id, hypothesis, reference) triples across processes.

(No script in this folder is named evaluate.py: Python puts a script's folder first on sys.path, and
such a script would shadow the Hugging Face package.)
"""

from __future__ import annotations

from pathlib import Path

from accelerate.utils import gather_object

HERE = Path(__file__).resolve().parent


class Scorer:
    """Corpus-level WER and CER, metric modules loaded on first use (main process only: loading
    copies them into the Hugging Face modules cache)."""

    def __init__(self):
        self.modules = None

    def __call__(self, hyps: list[str], refs: list[str]) -> dict[str, float]:
        if self.modules is None:
            import evaluate  # the Hugging Face package; slow to import, so only when scoring

            self.modules = [evaluate.load(str(HERE / "metrics" / name)) for name in ("wer", "cer")]
        wer, cer = (m.compute(predictions=hyps, references=refs) for m in self.modules)
        return {"wer": wer["wer"], "cer": cer["cer"]}


def gather_results(results: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Every process's (id, hyp, ref) → all of them, each utterance once, sorted by id.

    Collective: call on every rank. Duplicates (a sampler that pads by repeating utterances) are
    dropped by id, so each utterance is scored exactly once."""
    unique = {r[0]: r for r in gather_object(results)}
    return [unique[k] for k in sorted(unique)]
