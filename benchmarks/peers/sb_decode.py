"""Greedy-decode one snapshot of SpeechBrain's LibriSpeech Conformer-CTC recipe (run by SpeechBrain's
own interpreter, in the recipe's folder, for benchmarks/peers/asr.py).

    cd <recipe folder> && <speechbrain python> sb_decode.py HPARAMS.yaml SNAPSHOT OUT.jsonl [--override value ...]

HPARAMS and the overrides are the training's. The recipe's own code does the work: its `dataio_prepare`
(the audio and text pipelines), its SentencePiece model (trained by the run, in save_folder), its
`ASR.compute_forward` in the VALID stage, which is greedy CTC decoding (the TEST stage's beam search
of 100 is left out: every system in the comparison is scored greedy). Writes one
{"id", "ref", "hyp"} per test utterance.
"""

import json
import sys
from pathlib import Path

import speechbrain as sb
import torch
from hyperpyyaml import load_hyperpyyaml
from speechbrain.tokenizers.SentencePiece import SentencePiece
from speechbrain.utils.checkpoints import Checkpointer

sys.path.insert(0, ".")  # the recipe folder: its train.py and librispeech_prepare.py
import train as recipe  # noqa: E402  (its training runs under `if __name__ == "__main__"` only)


def main() -> None:
    hparams_file, snapshot, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    _, run_opts, overrides = sb.parse_arguments([hparams_file, *sys.argv[4:]])
    with open(hparams_file, encoding="utf-8") as f:
        hparams = load_hyperpyyaml(f, overrides)
    tokenizer = SentencePiece(model_dir=hparams["save_folder"], vocab_size=hparams["output_neurons"],
                              annotation_train=hparams["train_csv"], annotation_read="wrd",
                              model_type=hparams["token_type"], character_coverage=hparams["character_coverage"],
                              bos_id=hparams["bos_index"], eos_id=hparams["eos_index"])
    _, _, tests, _, _ = recipe.dataio_prepare(hparams, tokenizer)
    [test] = tests.values()
    brain = recipe.ASR(modules=hparams["modules"], hparams=hparams, run_opts=run_opts)
    brain.tokenizer = tokenizer
    loader = Checkpointer(snapshot.parent, recoverables=hparams["checkpointer"].recoverables)
    if loader.recover_if_possible(ckpt_predicate=lambda c: c.path.name == snapshot.name) is None:
        sys.exit(f"sb_decode.py: no checkpoint {snapshot}")
    brain.modules.eval()
    rows = []
    with torch.no_grad():
        for batch in sb.dataio.dataloader.make_dataloader(test, batch_size=8):
            _, _, tokens = brain.compute_forward(batch, sb.Stage.VALID)
            words = tokenizer(tokens, task="decode_from_list")
            rows += [{"id": i, "ref": r, "hyp": " ".join(w)} for i, r, w in zip(batch.id, batch.wrd, words)]
    out.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["id"])))
    print(f"{out}: {len(rows)} utterances")


if __name__ == "__main__":
    main()
