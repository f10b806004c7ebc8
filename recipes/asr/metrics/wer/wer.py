"""Word error rate, as a local `evaluate` module backed by `jiwer` (no download):

    import evaluate
    wer = evaluate.load("recipes/asr/metrics/wer")
    wer.compute(predictions=["the cat sat"], references=["the cat sat down"])  # {'wer': 0.25, ...}

Corpus-level: (substitutions + deletions + insertions) / reference words, summed over all pairs
(not a mean of per-utterance rates). Texts are compared as given: normalize them first.
"""

import datasets
import evaluate
import jiwer

_DESCRIPTION = "Word error rate: (S + D + I) / N over the whole corpus, computed with jiwer."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of hypothesis strings.
    references: list of reference strings (non-empty).
Returns:
    wer: corpus-level word error rate (float, 0 = perfect, may exceed 1);
    substitutions, deletions, insertions, reference_words: the counts behind it.
"""


class WER(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
            reference_urls=["https://github.com/jitsi/jiwer"],
        )

    def _compute(self, predictions, references):
        out = jiwer.process_words(list(references), list(predictions))
        n = out.hits + out.substitutions + out.deletions
        return {"wer": out.wer, "substitutions": out.substitutions, "deletions": out.deletions,
                "insertions": out.insertions, "reference_words": n}
