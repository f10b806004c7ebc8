"""Greedy-decode one snapshot of SpeechBrain's LibriSpeech CTC recipes (run by SpeechBrain's own
interpreter, in the recipe's folder, for benchmarks/peers/asr.py and selfsup.py).

    cd <recipe folder> && <speechbrain python> sb_decode.py [--recipe train_with_bestrq] HPARAMS.yaml SNAPSHOT OUT.jsonl [--override value ...]

HPARAMS and the overrides are the training's; --recipe names the recipe's module (default `train`,
the Conformer-CTC from scratch; `train_with_bestrq`, the fine-tuning of a BEST-RQ encoder). The
recipe's own code does the work: its `dataio_prepare` (the audio and text pipelines), its tokenizer
(`train`: the SentencePiece model the run trained; `train_with_bestrq`: the character encoder the run
wrote, both in save_folder), its `ASR.compute_forward` in the VALID stage, which is greedy CTC
decoding (the TEST stage's beam search is left out: every system in the comparison is scored
greedy). Writes one {"id", "ref", "hyp"} per test utterance.
"""

import importlib
import json
import sys
from pathlib import Path

import speechbrain as sb
import torch
from hyperpyyaml import load_hyperpyyaml
from speechbrain.tokenizers.SentencePiece import SentencePiece
from speechbrain.utils.checkpoints import Checkpointer

sys.path.insert(0, ".")  # the recipe folder: its train*.py and librispeech_prepare.py


def main() -> None:
    argv = sys.argv[1:]
    module = "train"
    if argv[:1] == ["--recipe"]:
        module, argv = argv[1], argv[2:]
    recipe = importlib.import_module(module)  # its training runs under `if __name__ == "__main__"` only
    hparams_file, snapshot, out = argv[0], Path(argv[1]), Path(argv[2])
    _, run_opts, overrides = sb.parse_arguments([hparams_file, *argv[3:]])
    with open(hparams_file, encoding="utf-8") as f:
        hparams = load_hyperpyyaml(f, overrides)
    if module == "train":
        tokenizer = SentencePiece(model_dir=hparams["save_folder"], vocab_size=hparams["output_neurons"],
                                  annotation_train=hparams["train_csv"], annotation_read="wrd",
                                  model_type=hparams["token_type"], character_coverage=hparams["character_coverage"],
                                  bos_id=hparams["bos_index"], eos_id=hparams["eos_index"])
        _, _, tests, _, _ = recipe.dataio_prepare(hparams, tokenizer)
        decode = lambda tokens: [" ".join(w) for w in tokenizer(tokens, task="decode_from_list")]  # noqa: E731
    else:  # the character encoder (label_encoder.txt in save_folder, written by the training)
        _, _, tests, tokenizer = recipe.dataio_prepare(hparams)
        decode = lambda tokens: ["".join(tokenizer.decode_ndim(t)) for t in tokens]  # noqa: E731
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
            rows += [{"id": i, "ref": r, "hyp": h} for i, r, h in zip(batch.id, batch.wrd, decode(tokens))]
    out.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["id"])))
    print(f"{out}: {len(rows)} utterances")


if __name__ == "__main__":
    main()
