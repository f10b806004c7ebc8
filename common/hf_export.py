"""Trained models in Hugging Face form, so they leave this repository.

- `save_feature_extractor(folder, ...)`: `preprocessor_config.json` + a copy of
  `common/speech_frontend.py`, so `AutoFeatureExtractor.from_pretrained(folder, trust_remote_code=True)`
  gives the recipes' exact features (global statistics included).
- `save_hf_ctc(folder, ...)`: a `Wav2Vec2BertForCTC` (`config.json`, `model.safetensors`) and its
  tokenizer (a `Wav2Vec2CTCTokenizer` that collapses spaces), for `pipeline("automatic-speech-recognition",
  model=folder, trust_remote_code=True)`. The recipe's weights map onto it by renaming `encoder.` → `wav2vec2_bert.`
  and `head.` → `lm_head.`; `recipe_ctc_weights` maps back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Wav2Vec2BertConfig

from common.speech_frontend import CharCTCTokenizer, StackedLogMelFeatureExtractor

FRONTEND_FILE = Path(__file__).with_name("speech_frontend.py")


def save_feature_extractor(folder: str | Path, *, n_mels: int, stack_frames: int, sample_rate: int,
                           mean: torch.Tensor, std: torch.Tensor) -> None:
    folder = Path(folder)
    extractor = StackedLogMelFeatureExtractor(feature_size=n_mels, sampling_rate=sample_rate,
                                              stack_frames=stack_frames, mean=mean.tolist(), std=std.tolist())
    extractor.register_for_auto_class("AutoFeatureExtractor")
    extractor.save_pretrained(folder)
    shutil.copyfile(FRONTEND_FILE, folder / FRONTEND_FILE.name)  # the code behind auto_map
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["auto_map"] = {"AutoFeatureExtractor": "speech_frontend.StackedLogMelFeatureExtractor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def hf_ctc_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Recipe names (encoder.*, head.*) → Wav2Vec2BertForCTC names; the statistics go elsewhere."""
    renamed = {}
    for k, v in weights.items():
        if k.startswith("encoder."):
            renamed["wav2vec2_bert." + k[len("encoder."):]] = v.contiguous()
        elif k.startswith("head."):
            renamed["lm_head." + k[len("head."):]] = v.contiguous()
    return renamed


def recipe_ctc_weights(weights: dict[str, torch.Tensor], mean: torch.Tensor, std: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of `hf_ctc_weights`, with the feature statistics put back as buffers."""
    renamed = {"feat_mean": mean, "feat_std": std}
    for k, v in weights.items():
        if k.startswith("wav2vec2_bert."):
            renamed["encoder." + k[len("wav2vec2_bert."):]] = v
        elif k.startswith("lm_head."):
            renamed["head." + k[len("lm_head."):]] = v
    return renamed


def save_hf_ctc(folder: str | Path, weights: dict[str, torch.Tensor], encoder_config: Wav2Vec2BertConfig,
                vocab: list[str] | None, vocab_size: int) -> None:
    """`weights`: the recipe's state dict (encoder.*, head.*, feat_mean, feat_std); `vocab`: the
    character tokens, index 0 the CTC blank, " " the word separator (None: no tokenizer written)."""
    folder = Path(folder)
    config = Wav2Vec2BertConfig(**{**encoder_config.to_dict(), "vocab_size": vocab_size, "pad_token_id": 0,
                                   "ctc_loss_reduction": "sum", "architectures": ["Wav2Vec2BertForCTC"],
                                   "final_dropout": 0.0})
    config.save_pretrained(folder)
    save_file(hf_ctc_weights(weights), folder / "model.safetensors", metadata={"format": "pt"})
    if vocab is None:
        return
    tokens = {("|" if t == " " else t): i for i, t in enumerate(vocab)}
    tokens["<unk>"] = len(vocab)  # never predicted (the head has len(vocab) classes)
    (folder / "vocab.json").write_text(json.dumps(tokens, ensure_ascii=False, indent=1))
    tokenizer = CharCTCTokenizer(str(folder / "vocab.json"), pad_token=vocab[0], unk_token="<unk>",
                                 word_delimiter_token="|", bos_token=None, eos_token=None)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())  # found through the shipped code
    config["auto_map"] = {"AutoTokenizer": ["speech_frontend.CharCTCTokenizer", None]}
    config["tokenizer_class"] = "CharCTCTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(FRONTEND_FILE, folder / FRONTEND_FILE.name)


def load_recipe_ctc_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The recipe's state dict from a folder in either form: a checkpoint (recipe names) or an
    exported `final/` (Wav2Vec2BertForCTC names + statistics in `preprocessor_config.json`)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights = load_file(folder / "model.safetensors")
    if "lm_head.weight" not in weights:
        return weights
    fe = json.loads((folder / "preprocessor_config.json").read_text())
    return recipe_ctc_weights(weights, torch.tensor(fe["mean"]), torch.tensor(fe["std"]))
