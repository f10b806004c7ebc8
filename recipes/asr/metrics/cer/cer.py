"""Character error rate, as a local `evaluate` module backed by `jiwer` (no download):

    import evaluate
    cer = evaluate.load("recipes/asr/metrics/cer")
    cer.compute(predictions=["the cat"], references=["the hat"])  # {'cer': 0.142857..., ...}

Corpus-level: (substitutions + deletions + insertions) / reference characters, summed over all
pairs; spaces count as characters (jiwer's convention). Texts are compared as given: normalize them first.
"""

import datasets
import evaluate
import jiwer

_DESCRIPTION = "Character error rate: (S + D + I) / N over the whole corpus, computed with jiwer."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of hypothesis strings.
    references: list of reference strings (non-empty).
Returns:
    cer: corpus-level character error rate (float, 0 = perfect, may exceed 1);
    substitutions, deletions, insertions, reference_chars: the counts behind it.
"""


class CER(evaluate.Metric):
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
        out = jiwer.process_characters(list(references), list(predictions))
        n = out.hits + out.substitutions + out.deletions
        return {"cer": out.cer, "substitutions": out.substitutions, "deletions": out.deletions,
                "insertions": out.insertions, "reference_chars": n}
