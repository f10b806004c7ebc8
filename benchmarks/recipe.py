"""What the benchmarks need from a recipe, built from the recipe's own modules and default config.

`load_recipe("best_rq" | "asr")` returns a namespace with:
- `cfg`: the recipe's Config (dataclass defaults < its config.yaml), with `overrides` applied;
- `train_set`: the built-in corpus' training manifest (generated on first use);
- `dataset`, `collator`: the recipe's training dataset and collator (epoch 0);
- `build_model()`: the recipe's model, freshly initialized;
- `loss(model, batch)`: the training loss of one batch, as the recipe's loop computes it.
A recipe's `train.py` stays the reference: this module only calls the same constructors.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ("data", "model", "text", "train", "ctc_decode", "scoring", "audio")


def _modules(recipe: str, *names: str):
    """Import a recipe folder's modules by their plain names (as its scripts do), then take the
    names out of sys.modules so that another recipe's `model`/`data` cannot collide."""
    saved_path, saved = sys.path[:], {n: sys.modules.pop(n) for n in LOCAL if n in sys.modules}
    sys.path.insert(0, str(ROOT / "recipes" / recipe))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path[:] = saved_path
        for n in LOCAL:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def load_recipe(recipe: str, overrides: list[str] = ()) -> SimpleNamespace:
    from common.config import parse_config
    from tools.corpus import resolve_data_dir
    from common.encoder import encoder_config_from
    from common.manifest import read_librispeech

    folder = ROOT / "recipes" / recipe
    if recipe == "best_rq":
        train, data, model = _modules(recipe, "train", "data", "model")
        cfg = parse_config(train.Config, list(overrides), default_yaml=folder / "config.yaml")
        train_set = read_librispeech(resolve_data_dir(None, None, cfg.builtin_corpus, "librispeech"), cfg.train_split)
        dataset = data.FeatureDataset(train_set, cfg.sample_rate, cfg.n_mels)
        collator = data.MaskingCollator(cfg)

        def build_model():
            return model.BestRQ(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                                codebook_size=cfg.codebook_size, code_dim=cfg.code_dim,
                                quantizer_seed=cfg.quantizer_seed)

        def loss(m, b):
            return m(b["feats"], b["feat_lens"], b["mask"], b["noise"])[0]

    elif recipe == "asr":
        train, data, model, text = _modules(recipe, "train", "data", "model", "text")
        cfg = parse_config(train.Config, list(overrides), default_yaml=folder / "config.yaml")
        root = resolve_data_dir(None, None, cfg.builtin_corpus, "librispeech")
        train_set = data.labelled_subset(data.read_split(root, cfg.train_split), cfg.train_fraction)
        tok_dir = Path(tempfile.mkdtemp(prefix="bench_tok_"))
        text.build_tokenizer(cfg.token_type, list(train_set["text"]), tok_dir, cfg.bpe_vocab_size)
        tokenizer = text.load_tokenizer(tok_dir)
        dataset = data.SpeechDataset(train_set, cfg, tokenizer, cfg.speed_perturb)
        collator = data.SpecAugmentCollator(cfg, augment=True)

        def build_model():
            return model.ConformerCTC(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                                      vocab_size=tokenizer.vocab_size)

        def loss(m, b):
            log_probs, out_lens = m(b["feats"], b["feat_lens"], b["time_mask"], b["freq_mask"])
            return model.ctc_loss(log_probs, out_lens, b["targets"], b["target_lens"])
    else:
        raise SystemExit(f"unknown recipe {recipe!r}: best_rq or asr")
    for obj in (dataset, collator):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(0)
    return SimpleNamespace(name=recipe, cfg=cfg, train_set=train_set, dataset=dataset, collator=collator,
                           build_model=build_model, loss=loss)
