"""Conformer-CTC: the encoder shared with BEST-RQ (`common.model.encoder`: a `transformers`
`Wav2Vec2BertModel` fed stacked log-mel frames) plus a linear CTC head; SpecAugment masks.

The parameter names are BEST-RQ's (`encoder.*`, buffers `feat_mean`, `feat_std`); a BEST-RQ run's
exported `final/encoder/` loads into it as any transformers folder of our front end does
(`common.model.hf_encoder.load_logmel_encoder`).
`export_hf` writes a trained model as a transformers `Wav2Vec2BertForCTC` (`common.model.hf_export`);
`evaluate` scores it on the validation set (loss, WER, CER) at train.py's evaluation steps.

`HFEncoderCTC`: the same CTC head on a transformers speech encoder that --init_from named
(common/model/hf_encoder.py: wav2vec 2.0, HuBERT, WavLM, Wav2Vec2-BERT), fed by that model's own
feature extractor (data.StockFrontend); exported as the family's stock `<Family>ForCTC`.
`ctc_model(cfg, vocab_size, frontend)` builds whichever the run's config records (`encoder_type`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Wav2Vec2BertConfig

from common.model.encoder import StackedLogMelEncoder, encoder_config_from
from common.model.hf_encoder import FAMILIES, build_encoder, feature_extractor
from common.model.hf_export import load_recipe_ctc_weights, save_ctc_tokenizer, save_feature_extractor, save_hf_ctc
from scoring import gather_results
from text import BLANK


class ConformerCTC(StackedLogMelEncoder):
    """The shared encoder (common/model/encoder.py: statistics, stacking, Conformer) + a linear CTC head."""

    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int, vocab_size: int):
        super().__init__(config, n_mels=n_mels, stack_frames=stack_frames)
        self.head = nn.Linear(config.hidden_size, vocab_size)  # class 0 = CTC blank
        # True when --init_from gave the feature statistics too (train.build_models): a fresh start
        # then keeps them instead of computing its own
        self.stats_given = False

    def forward(self, feats, feat_lens, time_mask=None, freq_mask=None):
        """feats: (B, T, n_mels) raw log-mel, T a multiple of `stack`; feat_lens: (B,) valid frames;
        time_mask: (B, T) and freq_mask: (B, n_mels) bool, SpecAugment (masked → 0 after normalization).
        Returns log-posteriors (B, T // stack, classes) in float32 and their valid lengths (B,)."""
        x = self.normalize(feats)
        if time_mask is not None:
            x = x.masked_fill(time_mask[:, :, None] | freq_mask[:, None, :], 0.0)
        hidden, out_lens = self.encode(x, feat_lens)  # (B, L, hidden), one frame per 40 ms
        return F.log_softmax(self.head(hidden).float(), dim=-1), out_lens


class HFEncoderCTC(nn.Module):
    """A transformers speech encoder (its own front end: the items carry its feature extractor's
    output) + a linear CTC head. Parameter names `encoder.*` (the family's bare model) and `head.*`."""

    def __init__(self, frontend: dict, vocab_size: int, overrides: dict):
        super().__init__()
        self.family = FAMILIES[frontend["model_type"]]
        self.encoder = build_encoder(frontend, overrides)
        self.head = nn.Linear(self.encoder.config.hidden_size, vocab_size)  # class 0 = CTC blank
        # As the stock pipeline does: an attention mask where the feature extractor makes one (a
        # group-norm wav2vec 2.0 was trained without: its padding is zeros the model sees)
        self.use_mask = bool(frontend["feature_extractor"].get("return_attention_mask", not self.family.raw))
        c = self.encoder.config
        self.masking = c.mask_time_prob > 0 or c.mask_feature_prob > 0
        self.stats_given = True  # the feature extractor normalizes each utterance: no global statistics

    def forward(self, feats, feat_lens, time_mask=None, freq_mask=None):
        """feats: (B, samples) normalized waveform, or (B, frames, dim) features; feat_lens: (B,) valid
        samples or frames. Returns log-posteriors (B, L, classes) in float32, L the encoder's frames
        (20 ms for the raw-waveform families, 20 ms for w2v-BERT's stacked fbank), and lengths (B,)."""
        valid = torch.arange(feats.shape[1], device=feats.device)[None, :] < feat_lens[:, None]
        x = feats.to(self.head.weight.dtype)  # FSDP2 bf16: the weights' dtype (a no-op otherwise)
        inputs = {"input_values" if self.family.raw else "input_features": x}
        with numpy_seeded(self.training and self.masking):
            hidden = self.encoder(**inputs, attention_mask=valid.long() if self.use_mask else None).last_hidden_state
        out_lens = self.encoder._get_feat_extract_output_lengths(feat_lens).clamp(max=hidden.shape[1])
        logits = self.head(hidden)
        if self.training and self.encoder.config.layerdrop > 0:
            # LayerDrop leaves a skipped layer's parameters out of the graph, which DDP refuses: each
            # parameter joins it with weight 0 (its gradient 0, as a skipped layer's is)
            logits = logits + 0.0 * sum(p.reshape(-1)[0] for p in self.parameters() if p.requires_grad)
        return F.log_softmax(logits.float(), dim=-1), out_lens


@contextmanager
def numpy_seeded(active: bool):
    """transformers' SpecAugment (`_compute_mask_indices`) draws from numpy's global generator: seed
    it from torch's, which the training loop reseeds from the batch position, so the masks are a
    function of the position (exact resume) and numpy's state is left as it was."""
    if not active:
        yield
        return
    state = np.random.get_state()
    np.random.seed(int(torch.randint(2**31 - 1, (1,))))
    try:
        yield
    finally:
        np.random.set_state(state)


def hf_overrides(cfg) -> dict:
    """The run's settings applied to a transformers encoder's config (transformers' script's names)."""
    masking = cfg.mask_time_prob > 0 or cfg.mask_feature_prob > 0
    return dict(hidden_dropout=cfg.dropout, feat_proj_dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
                activation_dropout=cfg.activation_dropout, layerdrop=cfg.layerdrop, apply_spec_augment=masking,
                mask_time_prob=cfg.mask_time_prob, mask_time_length=cfg.mask_time_length,
                mask_feature_prob=cfg.mask_feature_prob, mask_feature_length=cfg.mask_feature_length)


def ctc_model(cfg, vocab_size: int, frontend: dict | None = None) -> nn.Module:
    """The run's model: the Conformer on log-mel (`encoder_type` conformer), or a transformers encoder
    of the recorded `frontend` (frontend.json of the run: `read_frontend`'s record)."""
    if cfg.encoder_type == "conformer":
        return ConformerCTC(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                            vocab_size=vocab_size)
    return HFEncoderCTC(frontend, vocab_size, hf_overrides(cfg))


def frontend_dir(folder: Path) -> Path:
    """A checkpoint folder's frontend/ (final/ carries its own; a step folder uses its run's, as the tokenizer)."""
    folder = Path(folder)
    return folder / "frontend" if (folder / "frontend").is_dir() else folder.parent.parent / "frontend"


def checkpoint_frontend(folder: Path, cfg) -> dict | None:
    """The transformers front end a checkpoint's run recorded (None: the Conformer's log-mel)."""
    if cfg.encoder_type == "conformer":
        return None
    from common.training.faults import UsageError

    path = frontend_dir(folder) / "frontend.json"
    if not path.is_file():
        raise UsageError(f"--checkpoint {folder}: its run fine-tuned a {cfg.encoder_type} encoder but {path} is "
                         f"missing: give the run's output_dir or its final/, or the step folder inside its run folder")
    return json.loads(path.read_text())


def recipe_weights(folder: Path, cfg) -> dict[str, torch.Tensor]:
    """This recipe's state dict from a checkpoint or an export of either model kind."""
    if cfg.encoder_type == "conformer":
        return load_recipe_ctc_weights(folder)
    from common.training.averaging import checkpoint_weights

    weights = checkpoint_weights(folder)
    if "lm_head.weight" not in weights:
        return weights
    prefix = FAMILIES[cfg.encoder_type].prefix + "."
    return {("encoder." + k[len(prefix):] if k.startswith(prefix) else "head." + k[len("lm_head."):]): v
            for k, v in weights.items() if k.startswith((prefix, "lm_head."))}


def ctc_loss(log_probs, out_lens, targets, target_lens):
    """CTC loss summed over the batch and divided by its target tokens: nats per output token.

    `zero_infinity`: an utterance too short for its transcript (e.g. sped up) contributes nothing."""
    # fp32 whatever the compute dtype: FSDP2 with bf16 casts the model's outputs to bf16 (output_dtype)
    loss = F.ctc_loss(log_probs.float().transpose(0, 1), targets, out_lens, target_lens, blank=BLANK,
                      reduction="sum", zero_infinity=True)
    return loss / target_lens.sum().clamp_min(1)


def evaluate(model, loader, accelerator, tokenizer, scorer) -> tuple[dict, list[tuple[str, str, str]]]:
    """Validation CTC loss (every rank) and greedy WER/CER (main process), each utterance once, and
    every (id, hypothesis, reference) sorted by id (to show a few). Collective: call on every rank."""
    from ctc_decode import transcribe  # (ctc_decode imports this module's ctc_loss: imported when called)

    results, loss_sum, tokens = transcribe(model, loader, tokenizer)
    totals = accelerator.reduce(torch.tensor([loss_sum, tokens], dtype=torch.float64, device=accelerator.device), "sum")
    results = gather_results(results)  # collective
    row = {"eval_loss": (totals[0] / totals[1]).item()}
    if accelerator.is_main_process:  # metric modules run on the main process only
        scores = scorer([h for _, h, _ in results], [r for _, _, r in results])
        row.update(eval_wer=scores["wer"], eval_cer=scores["cer"])
    return row, results



def export_hf(folder: Path, weights: dict[str, torch.Tensor], cfg, tokenizer, frontend: dict | None = None) -> None:
    """A transformers encoder's run (`frontend`): `export_stock_ctc`. Otherwise: write `folder` as a transformers model: `Wav2Vec2BertForCTC` + feature extractor (+ for
    character tokens, a `Wav2Vec2CTCTokenizer`), loadable with `pipeline("automatic-speech-recognition",
    model=folder, trust_remote_code=True)`. `weights`: this recipe's state dict. Replaces
    `folder/model.safetensors` with the transformers names."""
    if getattr(cfg, "encoder_type", "conformer") != "conformer":  # (a namespace of the Conformer's fields: one)
        return export_stock_ctc(folder, weights, cfg, tokenizer, frontend)
    save_feature_extractor(folder, n_mels=cfg.n_mels, stack_frames=cfg.stack_frames, sample_rate=cfg.sample_rate,
                           mean=weights["feat_mean"], std=weights["feat_std"])
    # BPE pieces carry their word boundary inside ("▁the"), which Wav2Vec2CTCTokenizer cannot decode:
    # a BPE export has model and features in transformers form, and its tokenizer in tokenizer/bpe.model.
    vocab = tokenizer.vocab if tokenizer.kind == "char" else None
    save_hf_ctc(folder, weights, encoder_config_from(cfg), vocab, vocab_size=tokenizer.vocab_size)


def export_stock_ctc(folder: Path, weights: dict[str, torch.Tensor], cfg, tokenizer, frontend: dict) -> None:
    """`folder` as the family's stock `<Family>ForCTC` (the head as `lm_head`, the CTC blank as
    `pad_token_id`), its stock feature extractor and (character tokens) a stock `Wav2Vec2CTCTokenizer`:
    `pipeline("automatic-speech-recognition", model=folder)` with no remote code."""
    import transformers

    family = FAMILIES[frontend["model_type"]]
    model = HFEncoderCTC(frontend, tokenizer.vocab_size, hf_overrides(cfg))
    config = model.encoder.config
    config.update(dict(vocab_size=tokenizer.vocab_size, pad_token_id=0, ctc_loss_reduction="sum",
                       architectures=[family.ctc], final_dropout=0.0))
    ctc = getattr(transformers, family.ctc)(config)
    renamed = {(f"{family.prefix}." + k[len("encoder."):] if k.startswith("encoder.") else "lm_head." + k[len("head."):]): v
               for k, v in weights.items() if k.startswith(("encoder.", "head."))}
    ctc.load_state_dict(renamed, strict=True)  # every weight, by name and shape
    ctc.save_pretrained(folder)  # config.json, model.safetensors (replacing the recipe's)
    feature_extractor(frontend).save_pretrained(folder)
    if tokenizer.kind == "char":  # BPE: tokenizer/bpe.model only (no stock CTC tokenizer decodes pieces)
        save_ctc_tokenizer(folder, tokenizer.vocab, stock=True)
