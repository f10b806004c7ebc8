"""Non-autoregressive TTS (FastSpeech/FastPitch style) that learns its own alignment.

The aligner is the unsupervised alignment learner of Badlani et al. 2021, "One TTS Alignment To
Rule Them All" (arXiv:2108.10447):

- soft alignment: text embeddings and mel frames go through small conv stacks; the score of
  (frame t, symbol n) is −temperature·‖q_t − k_n‖², log-softmax over the symbols, plus the log of a
  static beta-binomial prior (scaling ω) that favours the diagonal early in training;
- forward-sum loss: CTC over those log-probabilities with a blank column, the targets being the
  symbols 1..N in order — the likelihood of all monotonic alignments;
- hard alignment: monotonic alignment search (Viterbi over monotonic paths, every symbol ≥ 1
  frame) on the soft alignment → integer durations that sum to the mel length;
- binarization loss: −mean log soft-attention on the hard path (switched on after a warm-up).

The durations drive the length regulator in training; a duration predictor (on detached encoder
states, in log(1 + d)) drives it at synthesis. No pitch or energy predictors (left out).
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from torch import nn

from frontend import Symbols  # noqa: F401  (Symbols is part of this module's interface: load_tts, synthesize)

NEG = -1e4  # "minus infinity" that keeps softmax/CTC gradients finite
LOSSES = ("mel_loss", "dur_loss", "len_loss", "align_loss", "bin_loss")  # the forward's losses, as logged


# ---------------------------------------------------------------------------------------------
# Alignment pieces (pure functions, unit-tested)
# ---------------------------------------------------------------------------------------------


def beta_binomial_prior(mel_len: int, text_len: int, scaling: float = 1.0) -> torch.Tensor:
    """(mel_len, text_len) static prior; row t is BetaBinomial(n=N−1, α=ω(t+1), β=ω(T−t)) over the
    symbols, so each row sums to 1 and its mass slides along the diagonal (Badlani et al., eq. 4)."""
    n = text_len - 1
    k = torch.arange(text_len, dtype=torch.float64)[None, :]
    t = torch.arange(1, mel_len + 1, dtype=torch.float64)[:, None]
    a, b = scaling * t, scaling * (mel_len + 1 - t)
    lbeta = lambda x, y: torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)  # noqa: E731
    log_choose = math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    return torch.exp(log_choose + lbeta(k + a, n - k + b) - lbeta(a, b)).float()


def forward_sum_loss(attn_logprob: torch.Tensor, text_lens: torch.Tensor, mel_lens: torch.Tensor,
                     blank_logprob: float = -1.0) -> torch.Tensor:
    """CTC over the soft alignment: −log Σ over monotonic paths, per symbol, mean over the batch.

    attn_logprob: (B, T, N) log-probabilities over symbols (padded symbols at NEG). A blank column
    with score `blank_logprob` is prepended and each frame renormalized; targets are 1..N_b."""
    B, T, N = attn_logprob.shape
    logp = F.pad(attn_logprob, (1, 0), value=blank_logprob).log_softmax(-1)  # (B, T, N + 1)
    targets = torch.arange(1, N + 1, device=attn_logprob.device).expand(B, N)
    return F.ctc_loss(logp.transpose(0, 1), targets, mel_lens, text_lens, blank=0, reduction="mean",
                      zero_infinity=True)


def mas(logprob: np.ndarray) -> np.ndarray:
    """Monotonic alignment search. logprob: (T, N) with T ≥ N. Returns the (T, N) 0/1 path that
    starts at (0, 0), ends at (T−1, N−1), advances by 0 or 1 symbol per frame, and maximizes the
    summed log-probability. On ties it advances (as FastPitch's `mas_width1`)."""
    T, N = logprob.shape
    if T < N:
        raise ValueError(f"cannot align {N} symbols to {T} frames")
    log_p = np.full((T, N), -np.inf)
    log_p[0, 0] = logprob[0, 0]
    advanced = np.zeros((T, N), dtype=bool)
    for i in range(1, T):
        stay = log_p[i - 1]
        move = np.concatenate([[-np.inf], log_p[i - 1, :-1]])
        advanced[i] = move >= stay
        log_p[i] = np.where(advanced[i], move, stay) + logprob[i]
    path = np.zeros((T, N), dtype=np.float32)
    j = N - 1
    for i in range(T - 1, -1, -1):
        path[i, j] = 1
        if i > 0 and advanced[i, j]:
            j -= 1
    return path


def mas_batch(logprob: torch.Tensor, text_lens: torch.Tensor, mel_lens: torch.Tensor) -> torch.Tensor:
    """(B, T, N) log-probs → (B, T, N) hard alignment (zeros outside each utterance)."""
    lp = logprob.detach().float().cpu().numpy()
    hard = np.zeros_like(lp)
    for b, (n, t) in enumerate(zip(text_lens.tolist(), mel_lens.tolist())):
        hard[b, :t, :n] = mas(lp[b, :t, :n])
    return torch.from_numpy(hard).to(logprob.device)


def length_regulate(x: torch.Tensor, durations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each symbol's state `durations` times. x: (B, N, D), durations: (B, N) ints ≥ 0.
    Returns ((B, max Σd, D) zero-padded, (B,) lengths Σd)."""
    lens = durations.sum(1)
    out = [torch.repeat_interleave(x[b], durations[b], dim=0) for b in range(x.shape[0])]
    return nn.utils.rnn.pad_sequence(out, batch_first=True), lens


def lengths_to_padding(lens: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """(B,) lengths → (B, max_len) bool, True at padding."""
    max_len = max_len or int(lens.max())
    return torch.arange(max_len, device=lens.device)[None, :] >= lens[:, None]


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout (`F.dropout`) whose mask costs a quarter of the random draws on CPU: 16 random
    bits per element, four per 64-bit draw, where `bernoulli_` makes a draw per element (with the
    self-attention below, config.yaml's model trains 1.14x faster on 2 CPU cores: results/README.md).
    An element is dropped with probability round(p·2¹⁶)/2¹⁶ (p = 0.1: 0.09998) and the kept ones scaled
    so that E[out] = x. Drawn from the default CPU generator, so seeding and a checkpoint's RNG state
    cover it. Other devices: `F.dropout`."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    drop = round(p * 65536)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2**63, 2**63 - 1)  # uniform 64-bit words
    keep = bits.view(torch.int16)[:n].view(x.shape) >= drop - 32768  # each 16 bits: P(keep) = 1 − drop/2¹⁶
    return x * (keep.to(x.dtype) * (65536 / (65536 - drop)))


def self_attention(mha: nn.MultiheadAttention, x: torch.Tensor, pad: torch.Tensor, training: bool) -> torch.Tensor:
    """`mha(x, x, x, key_padding_mask=pad)` with its weights and its attention dropout drawn by `dropout`
    (nn.MultiheadAttention's is `bernoulli_`). x (B, L, dim), pad (B, L) True at padding → (B, L, dim).
    Scores and softmax in fp32 whatever the weights' dtype."""
    B, L, dim = x.shape
    heads = mha.num_heads
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).view(B, L, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(dim // heads)  # (B, heads, L, L)
    weights = scores.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1).to(v.dtype)
    out = dropout(weights, mha.dropout, training) @ v  # (B, heads, L, dim / heads)
    return mha.out_proj(out.transpose(1, 2).reshape(B, L, dim))


def sinusoids(length: int, dim: int, device=None) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32, device=device)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim, device=device)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)
    return pe


class FFTBlock(nn.Module):
    """FastSpeech "feed-forward Transformer" block: self-attention + 1-D conv feed-forward, post-norm."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, kernel: int, dropout: float):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.conv1 = nn.Conv1d(dim, ffn_dim, kernel, padding=kernel // 2)
        self.conv2 = nn.Conv1d(ffn_dim, dim, 1)
        self.norm2 = nn.LayerNorm(dim)
        self.p = dropout

    def forward(self, x, pad):  # x (B, L, dim), pad (B, L) True at padding
        keep = (~pad)[..., None].to(x.dtype)
        drop = lambda h: dropout(h, self.p, self.training)  # noqa: E731
        x = self.norm1(x + drop(self_attention(self.attn, x, pad, self.training))) * keep
        h = self.conv2(drop(F.relu(self.conv1(x.transpose(1, 2))))).transpose(1, 2)
        return self.norm2(x + drop(h)) * keep


class DurationPredictor(nn.Module):
    """Two conv layers → log(1 + frames) per symbol."""

    def __init__(self, dim: int, channels: int, kernel: int, dropout: float):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(dim, channels, kernel, padding=kernel // 2),
                                    nn.Conv1d(channels, channels, kernel, padding=kernel // 2)])
        self.norms = nn.ModuleList([nn.LayerNorm(channels), nn.LayerNorm(channels)])
        self.p = dropout
        self.out = nn.Linear(channels, 1)

    def forward(self, x, pad):  # (B, N, dim) → (B, N)
        keep = (~pad)[..., None].to(x.dtype)
        for conv, norm in zip(self.convs, self.norms):
            x = dropout(norm(F.relu(conv((x * keep).transpose(1, 2)).transpose(1, 2))), self.p, self.training)
        return self.out(x).squeeze(-1) * keep.squeeze(-1)


class Aligner(nn.Module):
    """Soft alignment of mel frames (queries) to text embeddings (keys), Badlani et al. 2021 §3.1."""

    def __init__(self, n_mels: int, text_dim: int, att_dim: int, temperature: float):
        super().__init__()
        self.temperature = temperature
        self.key = nn.Sequential(nn.Conv1d(text_dim, 2 * text_dim, 3, padding=1), nn.ReLU(),
                                 nn.Conv1d(2 * text_dim, att_dim, 1))
        self.query = nn.Sequential(nn.Conv1d(n_mels, 2 * n_mels, 3, padding=1), nn.ReLU(),
                                   nn.Conv1d(2 * n_mels, n_mels, 1), nn.ReLU(), nn.Conv1d(n_mels, att_dim, 1))

    def forward(self, mel, text_emb, text_pad, log_prior):
        """mel (B, T, n_mels) normalized; text_emb (B, N, dim); text_pad (B, N); log_prior (B, T, N).
        Returns (soft (B, T, N) probabilities, logprob (B, T, N) = log-softmax score + log prior)."""
        # Convolutions in the weights' dtype (bf16 under FSDP2, which casts no input), the distances
        # and softmaxes in fp32: the alignment search and the forward-sum loss need the precision.
        dtype = self.query[0].weight.dtype
        q = self.query(mel.to(dtype).transpose(1, 2)).transpose(1, 2).float()  # (B, T, att)
        k = self.key(text_emb.to(dtype).transpose(1, 2)).transpose(1, 2).float()  # (B, N, att)
        dist = (q * q).sum(-1, keepdim=True) - 2 * q @ k.transpose(1, 2) + (k * k).sum(-1)[:, None, :]
        score = (-self.temperature * dist).masked_fill(text_pad[:, None, :], NEG)
        logprob = (score.log_softmax(-1) + log_prior).masked_fill(text_pad[:, None, :], NEG)
        return logprob.softmax(-1), logprob


class AlignedFastSpeech(nn.Module):
    def __init__(self, *, n_symbols: int, n_mels: int, dim: int, encoder_layers: int, decoder_layers: int,
                 heads: int, ffn_dim: int, kernel: int, dropout: float, duration_channels: int,
                 attention_dim: int, attention_temperature: float, blank_logprob: float):
        super().__init__()
        self.blank_logprob = blank_logprob
        # Global log-mel statistics (set once from the training data, then checkpointed).
        self.register_buffer("feat_mean", torch.zeros(n_mels))
        self.register_buffer("feat_std", torch.ones(n_mels))
        self.embed = nn.Embedding(n_symbols, dim, padding_idx=0)
        self.encoder = nn.ModuleList(FFTBlock(dim, heads, ffn_dim, kernel, dropout) for _ in range(encoder_layers))
        self.decoder = nn.ModuleList(FFTBlock(dim, heads, ffn_dim, kernel, dropout) for _ in range(decoder_layers))
        self.duration_predictor = DurationPredictor(dim, duration_channels, 3, dropout)
        self.aligner = Aligner(n_mels, dim, attention_dim, attention_temperature)
        self.mel_out = nn.Linear(dim, n_mels)

    def encode(self, tokens, text_lens):
        pad = lengths_to_padding(text_lens, tokens.shape[1])
        emb = self.embed(tokens)  # (B, N, dim)
        x = emb + sinusoids(tokens.shape[1], emb.shape[-1], emb.device).to(emb.dtype)
        for block in self.encoder:
            x = block(x, pad)
        return x, emb, pad

    def decode(self, enc, durations):
        x, lens = length_regulate(enc, durations)  # (B, T, dim)
        pad = lengths_to_padding(lens, x.shape[1])
        x = x + sinusoids(x.shape[1], x.shape[-1], x.device).to(x.dtype)
        for block in self.decoder:
            x = block(x, pad)
        return self.mel_out(x), lens  # normalized log-mel

    def forward(self, tokens, text_lens, mel, mel_lens, log_prior, binarize: bool):
        """Teacher-forced losses. tokens (B, N); mel (B, T, n_mels) raw log-mel; log_prior (B, T, N)."""
        target = (mel - self.feat_mean) / self.feat_std
        enc, emb, text_pad = self.encode(tokens, text_lens)
        soft, logprob = self.aligner(target, emb, text_pad, log_prior)
        hard = mas_batch(soft.clamp_min(1e-12).log(), text_lens, mel_lens)  # (B, T, N) 0/1
        durations = hard.sum(1).long()  # (B, N), Σ = mel_lens
        # Losses in fp32 whatever the compute dtype (FSDP2's bf16 outputs are cast up here; counts of
        # frames and symbols are not exact in bf16 above 256).
        pred = self.decode(enc, durations)[0].float()  # target: fp32 already (fp32 statistics buffers)
        frames = (~lengths_to_padding(mel_lens, mel.shape[1]))[..., None].float()
        mel_loss = (((pred - target) ** 2) * frames).sum() / (frames.sum() * mel.shape[-1])
        log_dur = self.duration_predictor(enc.detach(), text_pad).float()
        sym = (~text_pad).float()
        dur_loss = (((log_dur - torch.log1p(durations.float())) ** 2) * sym).sum() / sym.sum()
        # The per-symbol loss fits E[log(1 + d)], and exp of a mean log is below the mean: on a real
        # voice, whose durations vary a lot, speech synthesized from it came out ~17 % short. This
        # utterance-level term fits the total length (log frames) that inference will produce.
        total = (torch.expm1(log_dur) * sym).sum(1)  # (B,) predicted frames, before rounding
        len_loss = ((torch.log1p(total.clamp_min(0)) - torch.log1p(mel_lens.float())) ** 2).mean()
        align_loss = forward_sum_loss(logprob, text_lens, mel_lens, self.blank_logprob)
        bin_loss = -(soft.clamp_min(1e-12).log() * hard).sum() / hard.sum()
        return dict(mel_loss=mel_loss, dur_loss=dur_loss, len_loss=len_loss, align_loss=align_loss, bin_loss=bin_loss,
                    pred=pred * self.feat_std + self.feat_mean, soft=soft, hard=hard, durations=durations)

    @torch.no_grad()
    def infer(self, tokens, text_lens, pace: float = 1.0):
        """Predicted durations → raw log-mel (B, T, n_mels), lengths (B,), durations (B, N)."""
        enc, _, text_pad = self.encode(tokens, text_lens)
        frames = torch.expm1(self.duration_predictor(enc, text_pad).float()) / pace
        durations = frames.round().clamp_min(1).long().masked_fill(text_pad, 0)
        pred, lens = self.decode(enc, durations)
        pred = pred.float()
        return pred * self.feat_std + self.feat_mean, lens, durations


def build_model(cfg, symbols: str | None = None) -> "AlignedFastSpeech":
    """The model described by a TTS config (the dataclass, or a namespace read from a config.yaml), for
    the symbol table `symbols` (None: the config's, as a run's saved config.yaml records it)."""
    return AlignedFastSpeech(
        n_symbols=len(cfg.symbols if symbols is None else symbols) + 1, n_mels=cfg.n_mels, dim=cfg.dim,
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, heads=cfg.num_heads, ffn_dim=cfg.ffn_dim, kernel=cfg.conv_kernel,
        dropout=cfg.dropout, duration_channels=cfg.duration_channels, attention_dim=cfg.attention_dim,
        attention_temperature=cfg.attention_temperature, blank_logprob=cfg.blank_logprob)


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Teacher-forced losses on the validation set (each utterance once), weighted by utterances."""
    model.eval()
    totals = torch.zeros(len(LOSSES) + 1, device=accelerator.device)
    for batch in loader:
        out = model(batch["tokens"], batch["text_lens"], batch["mels"], batch["mel_lens"], batch["log_prior"], False)
        n = float(len(batch["ids"]))
        totals += torch.tensor([out[k].item() * n for k in LOSSES] + [n], device=accelerator.device)
    totals = accelerator.reduce(totals, "sum")
    model.train()
    return {f"eval_{k}": (totals[i] / totals[-1]).item() for i, k in enumerate(LOSSES)}


def load_tts(folder: str | Path, cfg=None, weights: dict | None = None):
    """(model in eval mode, its training config, Symbols, folder) from a TTS final/ or
    checkpoints/step_*/ folder. This repository's tools verify the folder first
    (common.training.sealing.resolve_checkpoint) and pass the run's Config as they read it
    (common.config.load_config), and the weights to use (common.training.averaging.checkpoint_weights:
    a checkpoint's weight average where its run kept one); without `cfg` (outside this repository,
    where that class is not), config.yaml's values are read as attributes, and without `weights` the
    folder's model.safetensors is loaded (a final/ holds the average already)."""
    folder = Path(folder)
    if cfg is None:
        cfg = types.SimpleNamespace(**yaml.safe_load((folder / "config.yaml").read_text()))
    if (folder / "symbols.json").is_file():  # final/ carries it; step folders have it in config.yaml (derived ones too)
        cfg.symbols = json.loads((folder / "symbols.json").read_text())["symbols"]
    model = build_model(cfg)
    model.load_state_dict(load_file(folder / "model.safetensors") if weights is None else weights)  # + feature statistics
    return model.eval(), cfg, Symbols.from_config(cfg), folder


def transfer_from(model: AlignedFastSpeech, symbols: str, folder: Path, weights: dict | None = None) -> str:
    """Initialize `model` (for the symbol table `symbols`) from another TTS run: another voice, or
    another language. Every weight is taken but the symbol embeddings, which are matched by symbol
    (a symbol the other table lacks keeps its random row), and the feature statistics, which this
    run computes from its own data. Refuses a model of another shape. Returns a summary line.
    `folder`: verified by the caller (common.training.sealing.resolve_checkpoint); `weights`: as
    load_tts's (None: its model.safetensors)."""
    their_cfg = yaml.safe_load((folder / "config.yaml").read_text())
    table = (json.loads((folder / "symbols.json").read_text())["symbols"] if (folder / "symbols.json").is_file()
             else their_cfg["symbols"])
    theirs, own = load_file(folder / "model.safetensors") if weights is None else weights, model.state_dict()
    skip = ("embed.weight", "feat_mean", "feat_std")
    differ = [f"{k} {tuple(theirs[k].shape)} != {tuple(v.shape)}" for k, v in own.items()
              if k not in skip and (k not in theirs or theirs[k].shape != v.shape)]
    if differ or theirs["embed.weight"].shape[1] != own["embed.weight"].shape[1]:
        raise ValueError(f"--init_from {folder}: its model has another shape ({'; '.join(differ[:3]) or 'embed.weight'}): "
                         f"set the model fields (dim, layers, heads, ffn_dim, n_mels, ...) to its config.yaml's")
    state = {k: v for k, v in theirs.items() if k not in skip}
    embed = own["embed.weight"].clone()  # row 0 is padding; symbol i is row i + 1 in both tables
    shared = [c for c in symbols if c in table]
    for c in shared:
        embed[symbols.index(c) + 1] = theirs["embed.weight"][table.index(c) + 1]
    model.load_state_dict({**state, "embed.weight": embed}, strict=False)
    return (f"initialized from {folder}: {len(shared)} of {len(symbols)} symbols shared "
            f"(new: {''.join(c for c in symbols if c not in table)!r})")


@torch.no_grad()
def synthesize(model, symbols: Symbols, text: str, vocoder=None, pace: float = 1.0):
    """→ (waveform (samples,) or None without a vocoder, log-mel (frames, n_mels), durations (N,))."""
    tokens = torch.tensor([symbols.encode(text)])
    mel, lens, durations = model.infer(tokens, torch.tensor([tokens.shape[1]]), pace)
    mel = mel[0, : int(lens[0])]
    return (vocoder(mel) if vocoder is not None else None), mel, durations[0]
