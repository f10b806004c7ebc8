"""transformers' CTC example script on our corpus: the data, the model it starts from, the script's
patches for the installed versions, and greedy decoding of its checkpoints. Used by `asr.py train
--system transformers`; a results script's helper (CI never runs it).

    PYTHONPATH=. python benchmarks/peers/hf_ctc.py export --data_dir DIR --out DATASET_DIR
    PYTHONPATH=. python benchmarks/peers/hf_ctc.py init --out MODEL_DIR [--seed 42 --conv_channels 256]
    PYTHONPATH=. python benchmarks/peers/hf_ctc.py decode --checkpoint CKPT --processor DIR --dataset DATASET_DIR --out HYPS

The script itself (`examples/pytorch/speech-recognition/run_speech_recognition_ctc.py`) lives only
in transformers' GitHub repository: `asr.py --hf_script PATH` takes it from a checkout.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SAMPLE_RATE = 16_000  # the feature extractor's rate (the built-in corpus and the prompts' librispeech/ are 16 kHz)

# Our encoder's size (recipes/asr/config.yaml: d_model 144, 4 layers, 4 heads, FFN 576) in
# wav2vec 2.0's architecture, which reads the waveform through 7 convolutions (strides 5,2,2,2,2,2,2:
# 20 ms frames) where ours reads 10-ms log-mels through a 4x subsampling. The convolutions keep
# their kernels and strides, at 256 channels instead of the base model's 512: 2.26 M parameters
# with the CTC head, against our 2.00 M.
MODEL = dict(hidden_size=144, num_hidden_layers=4, num_attention_heads=4, intermediate_size=576,
             conv_dim=(256,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
             num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16, feat_extract_norm="group",
             do_stable_layer_norm=False)

# What run_speech_recognition_ctc.py (as stored at transformers@8d3ba495, written for 4.50) needs to
# run on transformers 5.23 / datasets 5.2, each an exact text that must occur once. Nothing else
# in the script changes.
PATCHES = [
    # transformers 5 no longer has the telemetry call (it only reported the example's use).
    ("from transformers.utils import check_min_version, send_example_telemetry\n",
     "from transformers.utils import check_min_version\n"),
    ('    send_example_telemetry("run_speech_recognition_ctc", model_args, data_args)\n', ""),
    # datasets 4+ dropped loading scripts and with them load_dataset's trust_remote_code (a local
    # parquet folder needs none): both load_dataset calls lose that one argument.
    ("            split=data_args.train_split_name,\n            token=data_args.token,\n"
     "            trust_remote_code=data_args.trust_remote_code,\n",
     "            split=data_args.train_split_name,\n            token=data_args.token,\n"),
    ("            split=data_args.eval_split_name,\n            token=data_args.token,\n"
     "            trust_remote_code=data_args.trust_remote_code,\n",
     "            split=data_args.eval_split_name,\n            token=data_args.token,\n"),
    # transformers 5 removed TrainingArguments.overwrite_output_dir: read as False (its default), so
    # an output folder holding files but no checkpoint is still refused, and the vocabulary kept.
    ("and not training_args.overwrite_output_dir:\n",
     'and not getattr(training_args, "overwrite_output_dir", False):\n'),
    ("            if training_args.overwrite_output_dir and os.path.isfile(vocab_file):\n",
     '            if getattr(training_args, "overwrite_output_dir", False) and os.path.isfile(vocab_file):\n'),
    # transformers 5 configs no longer carry tokenizer_class: read as None (ours sets none), so the
    # tokenizer is chosen by model type, as before.
    ('            "config": config if config.tokenizer_class is not None else None,\n'
     '            "tokenizer_type": config.model_type if config.tokenizer_class is None else None,\n',
     '            "config": config if getattr(config, "tokenizer_class", None) is not None else None,\n'
     '            "tokenizer_type": config.model_type if getattr(config, "tokenizer_class", None) is None else None,\n'),
    # The script passes --model_name_or_path to trainer.train(resume_from_checkpoint=) whenever it is
    # a local folder (a previous run's checkpoint, say): from a folder holding only a model,
    # transformers 5 stops on the missing trainer_state.json. Training starts at step 0, as from a hub id.
    ("        elif os.path.isdir(model_args.model_name_or_path):\n"
     "            checkpoint = model_args.model_name_or_path\n", ""),
]


def patch_script(src: Path, dst: Path) -> list[str]:
    """Copy the script with PATCHES applied; returns what each changed. Refuses a script whose text
    differs from the one these patches were written for."""
    text = src.read_text(encoding="utf-8")
    done = []
    for old, new in PATCHES:
        if text.count(old) != 1:
            sys.exit(f"hf_ctc.py: {src} does not hold exactly one '{old.strip()[:70]}': this harness knows the "
                     "script as of transformers@8d3ba495 (4.50); give --hf_script that version")
        text = text.replace(old, new)
        done.append(f"- {old.strip()[:60]!r}")
    dst.write_text(text, encoding="utf-8")
    return done


def export(data_dir: Path, out: Path) -> dict[str, int]:
    """One parquet file per split, `<out>/data/<split>-00000-of-00001.parquet`, columns `audio`
    (datasets' Audio, the FLAC bytes as they are: decoded by `datasets` when the script reads them)
    and `text` (normalized as our recipe trains on and scores it); `load_dataset(out)` finds the
    splits by these names."""
    import datasets

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "recipes" / "asr"))
    from common.data.manifest import read_librispeech
    from text import normalize_text

    features = datasets.Features({"audio": datasets.Audio(sampling_rate=SAMPLE_RATE, decode=False),
                                  "text": datasets.Value("string"), "id": datasets.Value("string")})
    counts = {}
    for split in ("train", "validation", "test"):
        if not (data_dir / split).is_dir():
            continue
        rows = read_librispeech(data_dir, split)
        table = {"audio": [{"bytes": Path(r["path"]).read_bytes(), "path": Path(r["path"]).name} for r in rows],
                 "text": [normalize_text(r["text"]) for r in rows], "id": [r["id"] for r in rows]}
        ds = datasets.Dataset.from_dict(table, features=features).cast_column("audio", datasets.Audio(sampling_rate=SAMPLE_RATE))
        (out / "data").mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(out / "data" / f"{split}-00000-of-00001.parquet"))
        counts[split] = len(rows)
    if "train" not in counts or "test" not in counts:
        sys.exit(f"hf_ctc.py: {data_dir} needs train/ and test/ (LibriSpeech layout)")
    return counts


def init_model(out: Path, seed: int, conv_channels: int = 256) -> None:
    """What the script's --model_name_or_path reads: a config, a feature extractor and weights. No
    pretrained weights exist offline, so the weights are wav2vec 2.0's own initialization (seeded);
    saved without a CTC head, as a pre-trained checkpoint is: the script adds the head for its
    vocabulary."""
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    torch.manual_seed(seed)
    Wav2Vec2Model(Wav2Vec2Config(**{**MODEL, "conv_dim": (conv_channels,) * 7})).save_pretrained(out)
    # The base model's extractor (group norm: no attention mask, zero-padded, normalized waveform).
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0, do_normalize=True,
                             return_attention_mask=False).save_pretrained(out)


def decode(checkpoint: Path, processor_dir: Path, dataset: Path, out: Path, batch: int = 1) -> None:
    """Greedy CTC decoding of the test split with transformers' own code (the processor's
    batch_decode of the argmax, as the script's compute_metrics does), one jsonl row per utterance.
    One utterance at a time: this model (group norm over time, no attention mask) hears a padded
    utterance differently, and its output alone is the model's answer."""
    import datasets
    import numpy as np
    import soundfile as sf
    import torch
    from transformers import AutoModelForCTC, Wav2Vec2Processor

    processor = Wav2Vec2Processor.from_pretrained(processor_dir)
    model = AutoModelForCTC.from_pretrained(checkpoint).eval()
    test = datasets.load_dataset("parquet", data_files=str(dataset / "data" / "test-*.parquet"), split="train")
    test = test.cast_column("audio", datasets.Audio(decode=False))  # soundfile decodes: no torchcodec needed here
    rows = []
    for start in range(0, len(test), batch):
        part = test[start:start + batch]
        waves = [sf.read(io.BytesIO(a["bytes"]), dtype="float32")[0] for a in part["audio"]]
        inputs = processor(waves, sampling_rate=SAMPLE_RATE, return_tensors="pt", padding=True)
        with torch.inference_mode():
            logits = model(inputs.input_values).logits
        hyps = processor.batch_decode(np.argmax(logits.numpy(), axis=-1))
        rows += [{"id": i, "ref": r, "hyp": h} for i, r, h in zip(part["id"], part["text"], hyps)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export")
    e.add_argument("--data_dir", required=True)
    e.add_argument("--out", required=True)
    i = sub.add_parser("init")
    i.add_argument("--out", required=True)
    i.add_argument("--seed", type=int, default=42)
    i.add_argument("--conv_channels", type=int, default=256)
    d = sub.add_parser("decode")
    for name in ("--checkpoint", "--processor", "--dataset", "--out"):
        d.add_argument(name, required=True)
    args = parser.parse_args()
    if args.command == "export":
        print(json.dumps(export(Path(args.data_dir), Path(args.out))))
    elif args.command == "init":
        init_model(Path(args.out), args.seed, args.conv_channels)
    else:
        decode(Path(args.checkpoint), Path(args.processor), Path(args.dataset), Path(args.out))


if __name__ == "__main__":
    main()
