"""Trained models in Hugging Face form, so they leave this repository.

- `save_feature_extractor(folder, ...)`: `preprocessor_config.json` + a copy of
  `common/model/speech_frontend.py`, so `AutoFeatureExtractor.from_pretrained(folder, trust_remote_code=True)`
  gives the recipes' exact features (global statistics included).
- `save_hf_ctc(folder, ...)`: a `Wav2Vec2BertForCTC` (`config.json`, `model.safetensors`) and its
  tokenizer (a `Wav2Vec2CTCTokenizer` that collapses spaces), for `pipeline("automatic-speech-recognition",
  model=folder, trust_remote_code=True)`. The recipe's weights map onto it by renaming `encoder.` → `wav2vec2_bert.`
  and `head.` → `lm_head.`; `recipe_ctc_weights` maps back.
- `write_model_card(folder, ...)`: the `README.md` of every `final/` (recipe, command, data, metrics,
  versions), written before the folder is sealed.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import textwrap
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:  # transformers (~1 s to import) only where a transformers folder is written
    from transformers import Wav2Vec2BertConfig

FRONTEND_FILE = Path(__file__).with_name("speech_frontend.py")


def save_feature_extractor(folder: str | Path, *, n_mels: int, stack_frames: int, sample_rate: int,
                           mean: torch.Tensor, std: torch.Tensor) -> None:
    from common.model.speech_frontend import StackedLogMelFeatureExtractor  # imports transformers

    folder = Path(folder)
    extractor = StackedLogMelFeatureExtractor(feature_size=n_mels, sampling_rate=sample_rate,
                                              stack_frames=stack_frames, mean=mean.tolist(), std=std.tolist())
    extractor.register_for_auto_class("AutoFeatureExtractor")
    extractor.save_pretrained(folder)
    shutil.copyfile(FRONTEND_FILE, folder / FRONTEND_FILE.name)  # the code behind auto_map
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["auto_map"] = {"AutoFeatureExtractor": "speech_frontend.StackedLogMelFeatureExtractor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_code(folder: str | Path, prefix: str, modules: dict[str, str | Path]) -> None:
    """Copy the source files `modules` ({module name: file}) into `folder` as `<prefix>_<name>.py`,
    each import of another of them (`from <name> import`, `from common.<group>.<name> import`) renamed too,
    so that the folder's code imports only itself and installed packages, and its names collide
    with no other module on sys.path (`model` is every recipe's)."""
    for name, path in modules.items():
        code = Path(path).read_text()
        for other in modules:
            code = re.sub(rf"^from (common\.(\w+\.)?)?{other} import", f"from {prefix}_{other} import", code, flags=re.M)
        needs = re.search(r"^\s*(from|import) (common|tools)\b.*", code, flags=re.M)
        if needs:  # the export would load only beside this repository
            raise RuntimeError(f"{path} ({prefix}_{name}.py in an export) imports this repository: "
                               f"{needs.group(0).strip()}")
        (Path(folder) / f"{prefix}_{name}.py").write_text(code)


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
    from transformers import Wav2Vec2BertConfig

    folder = Path(folder)
    config = Wav2Vec2BertConfig(**{**encoder_config.to_dict(), "vocab_size": vocab_size, "pad_token_id": 0,
                                   "ctc_loss_reduction": "sum", "architectures": ["Wav2Vec2BertForCTC"],
                                   "final_dropout": 0.0})
    config.save_pretrained(folder)
    save_file(hf_ctc_weights(weights), folder / "model.safetensors", metadata={"format": "pt"})
    if vocab is not None:
        save_ctc_tokenizer(folder, vocab)


def save_ctc_tokenizer(folder: str | Path, vocab: list[str], stock: bool = False) -> None:
    """`vocab` (the character tokens, index 0 the CTC blank, " " the word separator, written "|") as a
    `Wav2Vec2CTCTokenizer`: ours that single-spaces its text (`CharCTCTokenizer`, shipped code), or
    (`stock`) transformers' own, which needs no remote code but keeps a doubled space where the model
    emits two word separators apart (decode.py single-spaces)."""
    from transformers import Wav2Vec2CTCTokenizer

    from common.model.speech_frontend import CharCTCTokenizer

    folder = Path(folder)
    tokens = {("|" if t == " " else t): i for i, t in enumerate(vocab)}
    tokens["<unk>"] = len(vocab)  # never predicted (the head has len(vocab) classes)
    (folder / "vocab.json").write_text(json.dumps(tokens, ensure_ascii=False, indent=1))
    tokenizer = (Wav2Vec2CTCTokenizer if stock else CharCTCTokenizer)(
        str(folder / "vocab.json"), pad_token=vocab[0], unk_token="<unk>", word_delimiter_token="|",
        bos_token=None, eos_token=None)
    tokenizer.save_pretrained(folder)
    if stock:
        return
    config = json.loads((folder / "tokenizer_config.json").read_text())  # found through the shipped code
    config["auto_map"] = {"AutoTokenizer": ["speech_frontend.CharCTCTokenizer", None]}
    config["tokenizer_class"] = "CharCTCTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(FRONTEND_FILE, folder / FRONTEND_FILE.name)


def load_recipe_ctc_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The recipe's state dict from a folder in either form: a checkpoint (recipe names; its weight
    average in place of the trained parameters when its run kept one, `--ema_decay`) or an exported
    `final/` (Wav2Vec2BertForCTC names + statistics in `preprocessor_config.json`)."""
    from common.training.averaging import checkpoint_weights

    folder = Path(folder)
    weights = checkpoint_weights(folder)
    if "lm_head.weight" not in weights:
        return weights
    fe = json.loads((folder / "preprocessor_config.json").read_text())
    return recipe_ctc_weights(weights, torch.tensor(fe["mean"]), torch.tensor(fe["std"]))


def _versions(packages=("torch", "torchaudio", "accelerate", "transformers", "datasets")) -> str:
    def one(name):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} (not installed)"

    return ", ".join([f"python {platform.python_version()}", *map(one, packages)])


def _last_rows(metrics_path: Path) -> tuple[dict | None, dict | None]:
    """The last logged row of `metrics.jsonl`, and the last one with validation values (`eval_*`)."""
    last = last_eval = None
    for line in metrics_path.read_text().splitlines() if metrics_path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        last = row
        if any(k.startswith("eval_") for k in row):
            last_eval = row
    return last, last_eval


def _command_lines(state) -> list[str]:
    """The card's command: each launch's (`TrainState.launches`) with the steps it trained, when the
    run was resumed; this process's alone for a state that records none."""
    from common.training.state import this_launch

    launches = getattr(state, "launches", None) or [this_launch(0, state.world_size)]
    # a launch killed before its first checkpoint trained nothing that was kept: the next starts where it did
    launches = [a for a, b in zip(launches, launches[1:]) if a["from_step"] < b["from_step"]] + launches[-1:]
    one = lambda launch: f"`{launch['command']}` ({launch['processes']} process(es), in `{launch['cwd']}`)"  # noqa: E731
    if len(launches) == 1 and launches[0]["from_step"] == 0:
        return [f"- command: {one(launches[0])}"]
    lines = [f"- commands: {len(launches)} launches, each resuming from the last checkpoint of the one before"]
    if launches[0]["from_step"] > 0:
        lines.append(f"  - steps 0–{launches[0]['from_step']}: not recorded (checkpoints written before launches were)")
    ends = [launch["from_step"] for launch in launches[1:]] + [state.step]
    lines += [f"  - steps {launch['from_step']}–{end}: {one(launch)}" for launch, end in zip(launches, ends)]
    return lines


def write_model_card(folder: str | Path, *, recipe: str, state, data_dir: str, metrics_path: str | Path,
                     usage: str, ended: str | None = None) -> None:
    """`<folder>/README.md`: what this model is and how it was made. Called from a recipe's
    `write_extras`, so the card is sealed with the weights (the `COMPLETE` digests cover it).

    `state` is the run's `TrainState` (step, processes, accumulation, `data` = manifest_summary of the
    training set, `launches` = the command of each launch that trained it: `this_launch`, from `sys.argv`
    as `accelerate launch` received it; its own options are not visible here, the process count is
    given beside it); `usage` is a
    short Markdown snippet on loading the folder (dedented); `ended` (optional) says how training ended
    and which weights the folder holds (early stopping: `EarlyStopping.card_line`)."""
    last, last_eval = _last_rows(Path(metrics_path))
    data = state.data or {}
    fmt = lambda row: json.dumps(row, sort_keys=False) if row else "(none logged)"  # noqa: E731
    lines = [
        f"# {recipe} model (speech-recipes)",
        "",
        f"Trained by `recipes/{recipe}/train.py` of speech-recipes for {state.step} optimizer steps on "
        f"{state.world_size} process(es) × accumulation {state.gradient_accumulation_steps}.",
        "",
        "## How it was made",
        "",
        *_command_lines(state),
        f"- finished: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"- versions: {_versions()}",
        "- config: `config.yaml` in this folder (every setting, resolved)",
        "",
        "## Data",
        "",
        f"- data_dir: `{data_dir}`",
        f"- training set: {data.get('utterances', '?')} utterances, {data.get('hours', 0.0):.3f} h, "
        f"fingerprint `{data.get('fingerprint', '?')}` (id, duration, text of every utterance)",
        "",
        "## Metrics at the end",
        "",
        f"- last logged step: `{fmt(last)}`",
        f"- last validation: `{fmt(last_eval)}`",
        *([f"- training ended: {ended}"] if ended else []),
        "",
        "## Use",
        "",
        textwrap.dedent(usage).strip(),
        "",
    ]
    (Path(folder) / "README.md").write_text("\n".join(lines))
