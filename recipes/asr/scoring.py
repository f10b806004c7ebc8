"""WER and CER through the `evaluate` metric modules shipped in metrics/ (no download), and the
gathering of (id, hypothesis, reference) triples across processes.

This folder holds a script named evaluate.py, and Python puts a script's folder first on sys.path:
a plain `import evaluate` from train.py or evaluate.py would import our script instead of the
Hugging Face package. `_hf_evaluate` imports the package with this folder taken off sys.path.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from accelerate.utils import gather_object

HERE = Path(__file__).resolve().parent


def _hf_evaluate():
    module = sys.modules.get("evaluate")
    if module is not None and hasattr(module, "load"):
        return module
    sys.modules.pop("evaluate", None)  # our script, imported by name by mistake
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    try:
        return importlib.import_module("evaluate")
    finally:
        sys.path[:] = saved


class Scorer:
    """Corpus-level WER and CER, metric modules loaded on first use (main process only: loading
    copies them into the Hugging Face modules cache)."""

    def __init__(self):
        self.modules = None

    def __call__(self, hyps: list[str], refs: list[str]) -> dict[str, float]:
        if self.modules is None:
            evaluate = _hf_evaluate()
            self.modules = [evaluate.load(str(HERE / "metrics" / name)) for name in ("wer", "cer")]
        wer, cer = (m.compute(predictions=hyps, references=refs) for m in self.modules)
        return {"wer": wer["wer"], "cer": cer["cer"]}


def gather_results(results: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Every process's (id, hyp, ref) → all of them, each utterance once, sorted by id.

    Collective: call on every rank. Duplicates (a sampler that pads by repeating utterances) are
    dropped by id, so each utterance is scored exactly once."""
    unique = {r[0]: r for r in gather_object(results)}
    return [unique[k] for k in sorted(unique)]
