"""Conformer-CTC: the encoder shared with BEST-RQ (`common.model.encoder`: a `transformers`
`Wav2Vec2BertModel` fed stacked log-mel frames) plus a linear CTC head; SpecAugment masks.

The parameter names are BEST-RQ's (`encoder.*`, buffers `feat_mean`, `feat_std`), so a BEST-RQ
`final/model.safetensors` loads into this model by name (`common.model.encoder.load_pretrained_encoder`).
`export_hf` writes a trained model as a transformers `Wav2Vec2BertForCTC` (`common.model.hf_export`);
`evaluate` scores it on the validation set (loss, WER, CER) at train.py's evaluation steps.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Wav2Vec2BertConfig

from common.model.encoder import StackedLogMelEncoder, encoder_config_from
from common.model.hf_export import save_feature_extractor, save_hf_ctc
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



def export_hf(folder: Path, weights: dict[str, torch.Tensor], cfg, tokenizer) -> None:
    """Write `folder` as a transformers model: `Wav2Vec2BertForCTC` + feature extractor (+ for
    character tokens, a `Wav2Vec2CTCTokenizer`), loadable with `pipeline("automatic-speech-recognition",
    model=folder, trust_remote_code=True)`. `weights`: this recipe's state dict. Replaces
    `folder/model.safetensors` with the transformers names."""
    save_feature_extractor(folder, n_mels=cfg.n_mels, stack_frames=cfg.stack_frames, sample_rate=cfg.sample_rate,
                           mean=weights["feat_mean"], std=weights["feat_std"])
    # BPE pieces carry their word boundary inside ("▁the"), which Wav2Vec2CTCTokenizer cannot decode:
    # a BPE export has model and features in transformers form, and its tokenizer in tokenizer/bpe.model.
    vocab = tokenizer.vocab if tokenizer.kind == "char" else None
    save_hf_ctc(folder, weights, encoder_config_from(cfg), vocab, vocab_size=tokenizer.vocab_size)
