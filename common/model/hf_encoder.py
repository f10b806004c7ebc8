"""A transformers speech encoder as the start of a recipe: what `--init_from` reads when it names a
folder written by `save_pretrained` (or a Hub id: the same folder, downloaded), ours included: one
code path for every such folder (`read_pretrained`).

Ours: a BEST-RQ run's `final/encoder/` (a `Wav2Vec2BertModel`) and an ASR run's `final/` (a
`Wav2Vec2BertForCTC`) are transformers folders too, whose `preprocessor_config.json` names our own
front end (`StackedLogMelFeatureExtractor`, common/model/speech_frontend.py: log-mel + global
statistics + frame stacking) instead of a stock one. The run folders they sit in (and a run's
`checkpoints/step_*/`, recipe names, its config.yaml beside) resolve to the same records
(`pretrained_folder`, `read_frontend`): the ASR recipe then fine-tunes its own Conformer on that
front end (`load_logmel_encoder`), with the shape and statistics the folder says.

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

from common.training.faults import RunError, UsageError
from common.training.sealing import MARKER, resolve_checkpoint, seal_problem

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
# Our front end's feature extractor (common/model/speech_frontend.py), as our exports name it in
# preprocessor_config.json. Its auto_map there points at the copy of that file they carry, which is
# never imported here: its settings and statistics are read as JSON, and the recipe computes them itself.
LOGMEL = "StackedLogMelFeatureExtractor"


def pretrained_folder(value: str | Path, flag: str = "--init_from") -> Path:
    """The folder `flag`'s `value` names, to read an encoder from: a Hub id, downloaded (`fetch_hub`); a
    transformers folder as it is (one inside a sealed folder, as a BEST-RQ `final/encoder/`, only when
    that seal holds); else one of our runs (its output_dir, final/ or checkpoints/step_*/), sealed
    (`resolve_checkpoint`), a BEST-RQ export's `encoder/` taken from its final/."""
    value = str(value)
    if is_hub_id(value):
        return fetch_hub(value, flag)
    path = Path(value)
    if (path / "config.json").is_file() and not any((path / name).exists() for name in ("config.yaml", MARKER)):
        problem = seal_problem(path.parent) if (path.parent / MARKER).is_file() else None
        if problem:
            raise UsageError(f"{flag} {path}: it is inside {path.parent}, whose seal fails: {problem}")
        return path
    folder = resolve_checkpoint(path, flag=flag)
    return folder / "encoder" if (folder / "encoder" / "config.json").is_file() else folder


def read_pretrained(value: str | Path, flag: str = "--init_from") -> dict:
    """`read_frontend`'s record of what `value` names (`pretrained_folder`), with that folder as "source"."""
    folder = pretrained_folder(value, flag)
    return {**read_frontend(folder, flag), "source": str(folder.resolve())}


def is_logmel(frontend: dict) -> bool:
    """A record of our own front end (a BEST-RQ or ASR run of this repository), not a stock one."""
    return frontend["feature_extractor"].get("feature_extractor_type") == LOGMEL


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
    "config": config.json, "feature_extractor": preprocessor_config.json}: the one place that decides
    which front end a folder needs: the family's stock feature extractor, or ours (`LOGMEL`, a
    wav2vec2-bert model: our exports). Refuses (RunError, one line) an unsupported `model_type`, remote
    code in config.json, or a folder without either front end. One of our checkpoints (config.yaml,
    no config.json): `checkpoint_frontend`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() and (folder / "config.yaml").is_file():
        return checkpoint_frontend(folder, flag)
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
    if kind == "wav2vec2-bert" and fe is not None and fe.get("feature_extractor_type") == LOGMEL:
        return check_logmel({"model_type": kind, "config": config, "feature_extractor": fe}, folder, flag)
    if fe is None or fe.get("feature_extractor_type") != family.feature_extractor or "auto_map" in fe:
        got = "none" if fe is None else fe.get("feature_extractor_type")
        raise RunError(f"{flag} {folder}: a {kind} model needs its stock {family.feature_extractor} in "
                       f"preprocessor_config.json (found: {got}); save it beside the model "
                       f"(`AutoFeatureExtractor.from_pretrained(<hub id>).save_pretrained(folder)`)")
    return {"model_type": kind, "config": config, "feature_extractor": fe}


def check_logmel(record: dict, folder, flag: str = "--init_from") -> dict:
    """`record` when its front end (ours) is whole: sizes, and statistics of `feature_size` values each,
    that fit the model's input (`feature_projection_input_dim` = feature_size × stack_frames)."""
    fe, config = record["feature_extractor"], record["config"]
    try:
        n, stack = int(fe["feature_size"]), int(fe["stack_frames"])
        whole = (int(fe["sampling_rate"]) > 0 and len(fe["mean"]) == len(fe["std"]) == n
                 and config.get("feature_projection_input_dim", n * stack) == n * stack)
    except (KeyError, TypeError, ValueError):
        whole = False
    if not whole:
        raise RunError(f"{flag} {folder}: its preprocessor_config.json ({LOGMEL}) lacks or misstates sampling_rate, "
                       f"feature_size, stack_frames, or feature_size values of mean and std for the model's input: "
                       f"export the run again (re-run its training command) or give the folder it came from")
    return record


def checkpoint_frontend(folder: Path, flag: str = "--init_from") -> dict:
    """The record of one of our checkpoints (recipe names in model.safetensors, the run's config.yaml
    beside): the log-mel front end and Conformer its config.yaml says (`EXPORTED_AS`: the names an export
    writes), the statistics its `feat_mean`/`feat_std` buffers hold. A run that fine-tuned a transformers
    encoder is refused (its final/ is that encoder's folder)."""
    import yaml
    from safetensors import safe_open

    from common.model.encoder import EXPORTED_AS

    saved = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    if saved.get("encoder_type", "conformer") != "conformer" or not all(k in saved for k in EXPORTED_AS):
        raise RunError(f"{flag} {folder}: a checkpoint of a run whose model is not this recipe's Conformer on "
                       f"log-mel (config.yaml: encoder_type {saved.get('encoder_type')!r}): give that run's final/")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        stats = {k: f.get_tensor(k).tolist() for k in ("feat_mean", "feat_std") if k in f.keys()}
    if len(stats) < 2:
        raise RunError(f"{flag} {folder}: its model.safetensors holds no feature statistics (feat_mean, feat_std): "
                       f"give a BEST-RQ or ASR run of this repository")
    record = {"model_type": "wav2vec2-bert", "config": {"model_type": "wav2vec2-bert"},
              "feature_extractor": {"feature_extractor_type": LOGMEL, "mean": stats["feat_mean"], "std": stats["feat_std"]}}
    for key, (file, name) in EXPORTED_AS.items():
        record[file][name] = saved[key]
    return check_logmel(record, folder, flag)


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
    with pickled weights only is refused with the conversion command. One of our checkpoints
    (`checkpoint_frontend`): its encoder's, bare (`encoder.` stripped; its weight average when it kept one)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file() and (folder / "config.yaml").is_file():
        from common.training.averaging import checkpoint_weights

        return {k[len("encoder."):]: v for k, v in checkpoint_weights(folder).items() if k.startswith("encoder.")}
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


def check_logmel_shape(frontend: dict, cfg, flag: str = "--init_from") -> None:
    """Refuse in one line, listing the differences, a `LOGMEL` record whose front end or Conformer
    shape (the MATCHING_KEYS, as `EXPORTED_AS` finds them in the record) is not `cfg`'s."""
    from common.model.encoder import EXPORTED_AS

    theirs = {key: frontend[part].get(name) for key, (part, name) in EXPORTED_AS.items()}
    differ = [f"{k}: pre-trained {v!r} != this run {getattr(cfg, k)!r}" for k, v in theirs.items() if v != getattr(cfg, k)]
    if differ:
        raise RunError(f"{flag} {frontend['source']}: the pre-trained encoder does not match this config (front end "
                       f"and encoder shape must equal pre-training): {'; '.join(differ)}; set these keys to the "
                       f"pre-trained run's values (its config.yaml, or the folder's config.json and preprocessor_config.json)")


def load_logmel_encoder(model: torch.nn.Module, frontend: dict, cfg, flag: str = "--init_from") -> None:
    """Our Conformer (`model`: a StackedLogMelEncoder) from a `LOGMEL` record's folder: its weights
    strictly (`load_encoder_weights`), its feature statistics into `feat_mean`/`feat_std`. A front end
    or encoder shape other than `cfg`'s is refused in one line listing the differences."""
    check_logmel_shape(frontend, cfg, flag)
    source = frontend["source"]
    load_encoder_weights(model.encoder, encoder_weights(source, flag), FAMILIES["wav2vec2-bert"].prefix, source, flag)
    fe = frontend["feature_extractor"]
    model.feat_mean.copy_(torch.tensor(fe["mean"], dtype=torch.float32))
    model.feat_std.copy_(torch.tensor(fe["std"], dtype=torch.float32))
