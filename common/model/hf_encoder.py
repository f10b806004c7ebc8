"""A transformers speech encoder as the start of a recipe: what `--init_from` reads when it names a
folder written by `save_pretrained` (or a Hub id: the same folder, downloaded).

The families a CTC fine-tune starts from, chosen by the folder's `config.json` `model_type`
(`FAMILIES`): wav2vec 2.0, HuBERT and WavLM (a convolutional front end over the raw waveform,
`Wav2Vec2FeatureExtractor`), and Wav2Vec2-BERT (w2v-BERT 2.0: a Conformer over 80-dim fbank stacked
by 2, `SeamlessM4TFeatureExtractor`). Each has a stock `<Family>ForCTC` class, which is what an ASR
run exports, so its `final/` loads with no remote code.

What such a folder may make us read (it carries no `COMPLETE` marker: nothing seals it): JSON
(`config.json`, `preprocessor_config.json`) and safetensors weights (`model.safetensors`, or shards
named by `model.safetensors.index.json`), none of which runs code. A folder whose weights are only
pickles (`pytorch_model.bin`, `*.pt`, `*.ckpt`) is refused with the conversion command; remote code
(`auto_map`, `trust_remote_code`) is never run. The weights must fit the config: a missing or
misshapen encoder weight is refused naming it; what a CTC model does not need (a quantizer, a
pre-training head, an `lm_head`) is dropped with one log line (`DROPPABLE`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from common.training.faults import RunError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    model: str  # the encoder class (transformers)
    ctc: str  # the stock CTC class an export is saved as
    prefix: str  # the encoder's attribute in `ctc` (its base_model_prefix)
    feature_extractor: str  # the stock feature extractor class
    raw: bool  # True: the model reads the waveform (samples,); False: (frames, dim) features


# (FSDP shards at the family's encoder layer class: Wav2Vec2EncoderLayer (or ...StableLayerNorm),
# HubertEncoderLayer, WavLMEncoderLayer, Wav2Vec2BertEncoderLayer; check_fsdp_wrap names it when the
# profile's differs.)
FAMILIES = {
    "wav2vec2": Family("Wav2Vec2Model", "Wav2Vec2ForCTC", "wav2vec2", "Wav2Vec2FeatureExtractor", True),
    "hubert": Family("HubertModel", "HubertForCTC", "hubert", "Wav2Vec2FeatureExtractor", True),
    "wavlm": Family("WavLMModel", "WavLMForCTC", "wavlm", "Wav2Vec2FeatureExtractor", True),
    "wav2vec2-bert": Family("Wav2Vec2BertModel", "Wav2Vec2BertForCTC", "wav2vec2_bert", "SeamlessM4TFeatureExtractor",
                            False),
}
# Encoder weights a pre-trained or CTC checkpoint holds that our CTC model does not use (prefix-free names).
DROPPABLE = re.compile(r"^(quantizer|project_q|project_hid|final_proj|label_embs_concat|lm_head|masked_spec_embed"
                       r"|encoder\.pos_conv_embed\.conv\.weight_[gv]$)")
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
CONVERT = ("convert it to safetensors once, where you trust it: python -c \"from transformers import AutoModel; "
           "AutoModel.from_pretrained('FOLDER').save_pretrained('FOLDER_st')\" and give FOLDER_st")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_encoder_folder(path: str | Path) -> bool:
    """A transformers folder (`config.json` with a `model_type`) that is not one of our run folders."""
    config = Path(path) / "config.json"
    if not config.is_file() or (Path(path) / "config.yaml").is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def is_hub_id(value: str) -> bool:
    """`owner/name` that names no local path: a Hub model id to download."""
    return bool(HUB_ID.match(value)) and not Path(value).exists()


def fetch_hub(repo_id: str, flag: str = "--init_from") -> Path:
    """Download the JSON and safetensors files of Hub model `repo_id` (nothing else: no pickle, no
    code) into the Hub cache; its folder. Offline (HF_HUB_OFFLINE) or unreachable: RunError naming
    the folder form. Hub requests wait HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT seconds at most."""
    fix = (f"with the network, `huggingface-cli download {repo_id} --local-dir <folder>` (or a `save_pretrained` "
           f"folder), then {flag} <folder>")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise RunError(f"{flag} {repo_id}: not a folder here, and the Hub is offline (HF_HUB_OFFLINE): {fix}")
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")  # seconds: an unreachable Hub fails fast, not after minutes
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # noqa: BLE001 — any Hub failure (no network, no such repo, gated) is the same refusal
        raise RunError(f"{flag} {repo_id}: not a folder here, and the Hub did not give it "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:200]}): {fix}") from None


def read_frontend(folder: str | Path, flag: str = "--init_from") -> dict:
    """What a transformers encoder folder says about itself, from its JSON alone: {"model_type",
    "config": config.json, "feature_extractor": preprocessor_config.json}. Refuses (RunError, one
    line) an unsupported `model_type`, remote code, or a folder without the stock feature extractor."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{flag} {folder}: config.json cannot be read ({e})") from None
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise RunError(f"{flag} {folder}: a transformers model of type {kind!r}, which this recipe cannot fine-tune "
                       f"for CTC; supported: {', '.join(FAMILIES)} (config.json model_type)")
    if "auto_map" in config:
        raise RunError(f"{flag} {folder}: its config.json asks for remote code (auto_map), which is never run: "
                       f"give a folder of the stock {FAMILIES[kind].model} class")
    family = FAMILIES[kind]
    try:
        fe = json.loads((folder / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        fe = None
    if fe is None or fe.get("feature_extractor_type") != family.feature_extractor or "auto_map" in fe:
        got = "none" if fe is None else fe.get("feature_extractor_type")
        raise RunError(f"{flag} {folder}: a {kind} model needs its stock {family.feature_extractor} in "
                       f"preprocessor_config.json (found: {got}); save it beside the model "
                       f"(`AutoFeatureExtractor.from_pretrained(<hub id>).save_pretrained(folder)`)")
    return {"model_type": kind, "config": config, "feature_extractor": fe}


def build_encoder(frontend: dict, overrides: dict):
    """The family's encoder (random weights) from a `read_frontend` record, `overrides` applied to its config."""
    import transformers

    family = FAMILIES[frontend["model_type"]]
    config_class = transformers.AutoConfig.for_model(frontend["model_type"]).__class__
    # WavLMConfig lacks mask_feature_min_masks, which WavLMModel reads when mask_feature_prob > 0
    # (transformers 5.x): the other families' default, 0 spans at least
    config = config_class.from_dict({"mask_feature_min_masks": 0, **frontend["config"], **overrides})
    return getattr(transformers, family.model)(config)


def feature_extractor(frontend: dict):
    """The stock feature extractor of a `read_frontend` record."""
    import transformers

    fe = dict(frontend["feature_extractor"])
    cls = getattr(transformers, fe.pop("feature_extractor_type"))
    fe.pop("processor_class", None)
    return cls(**fe)


def encoder_weights(folder: str | Path, flag: str = "--init_from") -> dict[str, torch.Tensor]:
    """The safetensors weights of a transformers folder (one file or index-named shards); a folder
    with pickled weights only is refused with the conversion command."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickles = sorted(p.name for pattern in PICKLES for p in folder.glob(pattern))
        what = f"only pickled weights ({', '.join(pickles)}), which can run code when read" if pickles else "no weights"
        raise RunError(f"{flag} {folder}: {what}; model.safetensors is read: "
                       + CONVERT.replace("FOLDER", str(folder)))
    weights = {}
    for name in files:
        weights.update(load_file(folder / name))
    return weights


def load_encoder_weights(encoder: torch.nn.Module, weights: dict, prefix: str, folder, flag: str = "--init_from") -> None:
    """Load `weights` (a bare encoder's names, or a `<Family>For*` model's under `prefix.`) into `encoder`,
    strictly: a missing or misshapen weight is refused naming it; DROPPABLE extras are dropped, logged."""
    bare = {k[len(prefix) + 1:] if k.startswith(prefix + ".") else k: v for k, v in weights.items()}
    own = encoder.state_dict()
    # weight-norm parametrizations are saved either way (weight_g/weight_v, or parametrizations.weight.original0/1)
    for old, new in ((".weight_g", ".parametrizations.weight.original0"), (".weight_v", ".parametrizations.weight.original1")):
        bare.update({k[: -len(old)] + new: v for k, v in list(bare.items())
                     if k.endswith(old) and k[: -len(old)] + new in own})
    dropped = sorted(k for k in bare if k not in own)
    unknown = [k for k in dropped if not DROPPABLE.match(k)]
    missing = [k for k in own if k not in bare and k != "masked_spec_embed"]  # masking's embedding: initialized
    shapes = [f"{k} {tuple(bare[k].shape)} != {tuple(v.shape)}" for k, v in own.items()
              if k in bare and bare[k].shape != v.shape]
    if unknown or missing or shapes:
        what = "; ".join(part for part in (f"unexpected {unknown[:4]}" if unknown else "",
                                           f"missing {missing[:4]}" if missing else "",
                                           f"misshapen {shapes[:3]}" if shapes else "") if part)
        raise RunError(f"{flag} {folder}: its weights do not fit its config.json ({what}): "
                       f"re-save the model with save_pretrained, or give the folder it came from")
    encoder.load_state_dict({k: v for k, v in bare.items() if k in own}, strict=False)
    kept = [k for k in dropped if not k.endswith((".weight_g", ".weight_v"))]
    if kept:
        logger.info(f"{flag} {folder}: {len(kept)} tensors a CTC model does not use dropped "
                    f"({', '.join(sorted({k.split('.')[0] for k in kept}))})")
