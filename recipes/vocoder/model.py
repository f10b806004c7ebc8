"""A Vocos-style generator (Siuzdak 2023: ConvNeXt at the mel frame rate, an inverse-STFT head that
predicts magnitude, optionally as a correction to the mel's least-squares inverse, and phase; at synthesis
its spectrum optionally refined, `Generator.refine`),
HiFi-GAN's multi-period discriminator and a multi-resolution STFT discriminator (UnivNet/Vocos), and the
least-squares GAN, feature-matching, spectral-convergence, anti-wrapping phase and STOI envelope losses, their
composition into the generator's and discriminators' losses, the validation and the start from another run
(the mel front end the mel losses take is train.py's: the repository's).

Self-contained (torch, safetensors, PyYAML; nothing of this repository): final/ carries a copy of
this file as `vocoder_model.py`, so `load_vocoder(final/)` works from anywhere.
"""

from __future__ import annotations

import functools
import math
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MEL_KEYS = ("sample_rate", "n_mels", "win_length", "hop_length")  # what must match a TTS model's mel
SC_RESOLUTIONS = (1024, 2048)  # n_fft of --sc_loss_weight's STFTs, hop n_fft / 4
REFINE_HEAD_WEIGHT = 0.25  # the head's share of the refined log-magnitude, the rest the output signal's (`Generator.refine`)
HIFIGAN_MEL_SCALE = 1 / (2 * math.log(10))  # natural-log power mel → log10 amplitude mel (HiFi-GAN's loss scale)


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    """Depthwise conv (7) → LayerNorm → pointwise MLP (GELU) → layer scale, residual. (B, C, T) → (B, C, T)."""

    def __init__(self, dim: int, hidden: int, layer_scale: float):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x):
        y = self.norm(self.dwconv(x).transpose(1, 2))  # (B, T, C)
        y = self.gamma * self.pw2(F.gelu(self.pw1(y)))
        return x + y.transpose(1, 2)


class Generator(nn.Module):
    """Log-mel (B, frames, n_mels) → waveform (B, (frames − 1) · hop): every frame predicts one STFT
    column (log magnitude and phase of n_fft/2 + 1 bins), and the inverse STFT (centred, Hann window
    of n_fft, the mel's own hop) turns them into samples. Nothing runs at the sample rate, which is
    why it costs a fraction of HiFi-GAN's upsampling stack per audio second."""

    def __init__(self, n_mels: int, n_fft: int, hop_length: int, dim: int, hidden: int, layers: int,
                 sample_rate: int, magnitude_prior: bool = False, refine_iters: int = 0):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop_length
        self.refine_iters = refine_iters  # what `vocode` does after the network (`refine`); not a weight
        # The mel's filters (n_fft/2 + 1, n_mels), and with the prior the head predicts the log magnitude as a
        # correction to their least-squares inverse (FreeV, Lv et al. 2024: the magnitude Griffin-Lim starts
        # from), so every bin's envelope over time comes from the mel itself. Not in the state dict: formulas.
        basis = htk_mel_filterbank(n_fft // 2 + 1, n_mels, sample_rate)
        self.register_buffer("mel_basis", basis, persistent=False)
        inverse = torch.linalg.pinv(basis.T.double()).float() if magnitude_prior else None
        self.register_buffer("mel_inverse", inverse, persistent=False)
        self.embed = nn.Conv1d(n_mels, dim, 7, padding=3)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.blocks = nn.ModuleList(ConvNeXtBlock(dim, hidden, 1.0 / layers) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, n_fft + 2)  # log magnitude and phase, n_fft/2 + 1 bins each
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def spectrum(self, mel: torch.Tensor, with_phase: bool = False):
        """(B, frames, n_mels) log-mel → (B, n_fft/2 + 1, frames) complex STFT (and, `with_phase`, the
        phase the head predicts, in radians, unwrapped: the same shape)."""
        x = self.norm(self.embed(mel.transpose(1, 2)).transpose(1, 2)).transpose(1, 2)  # (B, dim, T)
        for block in self.blocks:
            x = block(x)
        log_mag, phase = self.head(self.final_norm(x.transpose(1, 2))).transpose(1, 2).chunk(2, dim=1)
        if self.mel_inverse is not None:  # + ½ log of the least-squares power spectrum, floored as the mel is
            power = (torch.exp(mel.float()) @ self.mel_inverse.T).clamp_min(1e-6)  # (B, T, bins)
            log_mag = log_mag + 0.5 * torch.log(power).transpose(1, 2)
        # The clamp keeps early steps finite. 1e3, not Vocos' 1e2: a loud voice's harmonics pass 100 (the
        # Italian prompts' in a third of their utterances, at n_fft 1024), and a capped bin gets no gradient.
        mag = torch.exp(log_mag).clamp(max=1e3)
        spec = torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))
        return (spec, phase) if with_phase else spec

    def stft(self, wav: torch.Tensor) -> torch.Tensor:
        """(B, samples) → (B, n_fft/2 + 1, frames) complex: the centred STFT the head's columns are."""
        return torch.stft(wav, self.n_fft, self.hop, self.n_fft, self.window, center=True, return_complex=True)

    def istft(self, spec: torch.Tensor, samples: int) -> torch.Tensor:
        """(B, n_fft/2 + 1, frames) complex → (B, samples): `stft`'s inverse (overlap-add)."""
        return torch.istft(spec, self.n_fft, self.hop, self.n_fft, self.window, center=True, length=samples)

    def forward(self, mel: torch.Tensor, with_phase: bool = False):
        """(B, frames, n_mels) log-mel → (B, (frames − 1) · hop) waveform (and, `with_phase`, spectrum's phase)."""
        spec, phase = self.spectrum(mel, with_phase=True)
        samples = (mel.shape[1] - 1) * self.hop  # the centred mel of these samples has mel.shape[1] frames
        wav = self.istft(spec, samples)
        return (wav, phase) if with_phase else wav

    def refine(self, mel: torch.Tensor, iters: int) -> torch.Tensor:
        """(B, frames, n_mels) log-mel → (B, samples) waveform: the network's output made to agree with the mel
        and with itself, at synthesis only (results/vocoder/RESULTS.md, "Phase refinement"). The head's phases
        need not be those of any signal (an STFT whose neighbouring frames disagree at a harmonic cancels part of
        it in the overlap-add, which is where the output's STOI was lost), and its magnitude is trained only
        through that overlap-add.
        So: (1) the magnitude to keep is a weighted geometric mean of two: the head's (sharp harmonics; weight
        REFINE_HEAD_WEIGHT) and that of the STFT of the output signal (a real signal's: its energy sits where
        the signal puts it, so a pause or a stop closure stays quiet, which an ASR model hears), each bin then
        scaled so that the spectrum's mel is the input mel (the gain of each mel band spread over its bins by
        the filters' weights); (2) `iters` Griffin-Lim iterations with momentum 0.99 (Perraudin et al. 2013)
        start from the output signal's phases, not from random ones, and keep that magnitude."""
        head = self.spectrum(mel)  # (B, bins, T)
        samples = (mel.shape[1] - 1) * self.hop
        spec = self.stft(self.istft(head, samples))  # the spectrum of the output signal (`forward`'s)
        mag = head.abs() ** REFINE_HEAD_WEIGHT * spec.abs() ** (1 - REFINE_HEAD_WEIGHT)
        band_gain = torch.exp(mel.float()) / ((mag.transpose(1, 2) ** 2) @ self.mel_basis).clamp_min(1e-10)  # (B, T, n_mels)
        weight = self.mel_basis.sum(1)  # (bins,): 0 above the top filter, where the gain is 1
        gain = (band_gain @ self.mel_basis.T) / weight.clamp_min(1e-10)  # (B, T, bins)
        gain = torch.where(weight > 0, gain, torch.ones_like(gain)).transpose(1, 2)
        mag = (mag * gain.sqrt()).clamp(max=1e3)
        phase = spec / spec.abs().clamp_min(1e-8)
        previous = torch.zeros_like(spec)
        for _ in range(iters):
            rebuilt = self.stft(self.istft(mag * phase, samples))
            phase = rebuilt - (0.99 / 1.99) * previous  # the momentum step of "fast" Griffin-Lim
            phase = phase / phase.abs().clamp_min(1e-8)
            previous = rebuilt
        return self.istft(mag * phase, samples)


# ---------------------------------------------------------------------------------------------
# Discriminators
# ---------------------------------------------------------------------------------------------


class PeriodDiscriminator(nn.Module):
    """HiFi-GAN's sub-discriminator of one period p: the waveform folded into (T/p, p), 2-D convs
    along time only. → (score map, feature maps)."""

    def __init__(self, period: int, channels: list[int]):
        super().__init__()
        self.period = period
        ins = [1, *channels]
        self.convs = nn.ModuleList(nn.Conv2d(ins[i], ins[i + 1], (5, 1), (3, 1) if i < len(channels) - 1 else 1,
                                             padding=(2, 0)) for i in range(len(channels)))
        self.post = nn.Conv2d(channels[-1], 1, (3, 1), padding=(1, 0))

    def forward(self, wav):  # (B, samples)
        pad = -wav.shape[-1] % self.period
        x = F.pad(wav, (0, pad), mode="reflect")[:, None]
        x = x.view(x.shape[0], 1, -1, self.period)  # (B, 1, T/p, p)
        feats = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            feats.append(x)
        x = self.post(x)
        feats.append(x)
        return x.flatten(1), feats


class ResolutionDiscriminator(nn.Module):
    """A sub-discriminator on the magnitude STFT of one resolution (UnivNet, as in Vocos): 2-D convs
    over (frequency, time). → (score map, feature maps)."""

    def __init__(self, n_fft: int, hop: int, channels: int):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        self.convs = nn.ModuleList([
            nn.Conv2d(1, channels, (7, 5), padding=(3, 2)),
            nn.Conv2d(channels, channels, (5, 3), (2, 1), padding=(2, 1)),
            nn.Conv2d(channels, channels, (5, 3), (2, 1), padding=(2, 1)),
            nn.Conv2d(channels, channels, (3, 3), padding=(1, 1)),
        ])
        self.post = nn.Conv2d(channels, 1, (3, 3), padding=(1, 1))

    def forward(self, wav):
        spec = torch.stft(wav, self.n_fft, self.hop, self.n_fft, self.window, center=True, return_complex=True)
        x = spec.abs()[:, None]  # (B, 1, freq, frames)
        feats = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            feats.append(x)
        x = self.post(x)
        feats.append(x)
        return x.flatten(1), feats


class Discriminators(nn.Module):
    """The multi-period (HiFi-GAN) and the multi-resolution STFT discriminators, held as one model so
    that one optimizer (HiFi-GAN: one AdamW for both) clips and updates them together. Each keeps
    its own modules: `.mpd`, `.mrd`. waveform (B, samples) → [(scores, feature maps)] per sub-discriminator."""

    def __init__(self, periods: list[int], period_channels: list[int], resolutions: list[int], resolution_channels: int):
        super().__init__()
        self.mpd = nn.ModuleList(PeriodDiscriminator(p, period_channels) for p in periods)
        self.mrd = nn.ModuleList(ResolutionDiscriminator(n, n // 4, resolution_channels) for n in resolutions)

    def forward(self, wav):
        return [d(wav) for d in (*self.mpd, *self.mrd)]


# ---------------------------------------------------------------------------------------------
# Losses (least-squares GAN, feature matching, spectral convergence, phase)
# ---------------------------------------------------------------------------------------------


def discriminator_loss(real: list, fake: list) -> torch.Tensor:
    """LSGAN: Σ over sub-discriminators of mean((1 − D(real))²) + mean(D(fake)²)."""
    return sum(torch.mean((1 - r) ** 2) + torch.mean(f ** 2) for (r, _), (f, _) in zip(real, fake))


def adversarial_loss(fake: list) -> torch.Tensor:
    """LSGAN, generator side: Σ mean((1 − D(fake))²)."""
    return sum(torch.mean((1 - f) ** 2) for f, _ in fake)


def feature_matching_loss(real: list, fake: list) -> torch.Tensor:
    """Σ over sub-discriminators and layers of mean |features(real) − features(fake)| (real detached)."""
    return sum(torch.mean(torch.abs(r.detach() - f)) for (_, rs), (_, fs) in zip(real, fake) for r, f in zip(rs, fs))


@functools.lru_cache(maxsize=8)
def _hann(n_fft: int, device) -> torch.Tensor:
    return torch.hann_window(n_fft, device=device)


def spectral_convergence(real: torch.Tensor, fake: torch.Tensor, resolutions: tuple[int, ...]) -> torch.Tensor:
    """Mean over `resolutions` (n_fft; hop n_fft / 4) of ‖|STFT(real)| − |STFT(fake)|‖_F / ‖|STFT(real)|‖_F
    (whole batch)."""
    total = 0.0
    for n_fft in resolutions:
        spec = lambda x: torch.stft(x, n_fft, n_fft // 4, window=_hann(n_fft, x.device), return_complex=True).abs()  # noqa: E731
        S = spec(real)
        total = total + torch.linalg.vector_norm(S - spec(fake)) / torch.linalg.vector_norm(S).clamp_min(1e-7)
    return total / len(resolutions)


def anti_wrapped(x: torch.Tensor) -> torch.Tensor:
    """|x − 2π · round(x / 2π)|: a phase difference's distance from 0 on the circle, in [0, π]."""
    return torch.abs(x - 2 * math.pi * torch.round(x / (2 * math.pi)))


def phase_loss(real: torch.Tensor, phase: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """APNet's IP + GD + IAF anti-wrapping losses of the predicted `phase` (B, bins, frames) against
    the STFT phase of `real` (B, samples; the generator's STFT: Hann n_fft, hop, centred), each bin's
    error weighted by the recording's magnitude over its batch mean (a difference: by its two bins'
    geometric mean), so that the harmonics count and the noise does not."""
    spec = torch.stft(real, n_fft, hop, window=_hann(n_fft, real.device), center=True, return_complex=True)
    target, weight = spec.angle(), spec.abs()
    weight = weight / weight.mean().clamp_min(1e-7)
    ip = (weight * anti_wrapped(target - phase)).mean()
    diff = lambda x, d: x.diff(dim=d)  # noqa: E731
    pair = lambda d: torch.sqrt(weight.narrow(d, 1, weight.shape[d] - 1) * weight.narrow(d, 0, weight.shape[d] - 1))  # noqa: E731
    gd = (pair(1) * anti_wrapped(diff(target, 1) - diff(phase, 1))).mean()
    iaf = (pair(2) * anti_wrapped(diff(target, 2) - diff(phase, 2))).mean()
    return ip + gd + iaf


# STOI's bands (Taal et al. 2011; pystoi's values): 15 one-third-octave bands, the first centred at 150 Hz
STOI_BANDS, STOI_LOW_HZ, STOI_CLIP, STOI_DYN_RANGE_DB = 15, 150.0, 1 + 10 ** (15 / 20), 40.0


@functools.lru_cache(maxsize=8)
def third_octave_matrix(n_fft: int, sample_rate: int, device) -> torch.Tensor:
    """(15, n_fft // 2 + 1) 0/1: bin k in band j when centre_j · 2^-1/6 ≤ f_k < centre_j · 2^1/6."""
    freqs = torch.arange(n_fft // 2 + 1, dtype=torch.float64) * sample_rate / n_fft
    centres = STOI_LOW_HZ * 2.0 ** (torch.arange(STOI_BANDS, dtype=torch.float64) / 3)
    lo, hi = centres * 2 ** (-1 / 6), centres * 2 ** (1 / 6)
    return ((freqs[None] >= lo[:, None]) & (freqs[None] < hi[:, None])).float().to(device)


def envelope_frame(sample_rate: int) -> int:
    """`envelope_loss`'s frame in samples: STOI's 25.6 ms, rounded to a power of two (512 at 22.05 kHz)."""
    return 1 << round(math.log2(sample_rate * 0.0256))


def envelope_loss(real: torch.Tensor, fake: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """1 − STOI of each training segment, differentiable (the training use of Kolbæk et al. 2018):
    STOI's one-third-octave band envelopes (frames of ~23 ms, hop ~11.6 ms: a 0.37 s segment is about
    one of STOI's 384 ms windows), the generated envelope scaled to the recording's energy per band and
    clipped at STOI's −15 dB bound, then the correlation of the two over the recording's speech frames
    (within 40 dB of its loudest; a segment with fewer than 8 counts nothing). real, fake: (B, samples)."""
    win = envelope_frame(sample_rate)
    n_fft = 2 * win  # STOI's zero padding: bins ~ half its band width at 150 Hz
    bands = third_octave_matrix(n_fft, sample_rate, real.device)
    window = _hann(win, real.device)

    def envelopes(x):  # (B, 15, frames): the band's root energy
        spec = torch.stft(x, n_fft, win // 2, win_length=win, window=window, center=False, return_complex=True)
        power = spec.real ** 2 + spec.imag ** 2
        return torch.sqrt(bands @ power + 1e-10), power.sum(1)

    x, energy = envelopes(real)
    y, _ = envelopes(fake)
    level = 10 * torch.log10(energy + 1e-10)  # (B, frames) dB
    speech = (level > level.amax(1, keepdim=True) - STOI_DYN_RANGE_DB).float()[:, None]  # (B, 1, frames)
    count = speech.sum(-1, keepdim=True)  # (B, 1, 1)
    norm = lambda v: torch.sqrt((speech * v ** 2).sum(-1, keepdim=True) + 1e-10)  # noqa: E731
    y = torch.minimum(y * norm(x) / norm(y), x * STOI_CLIP)
    centre = lambda v: (v - (speech * v).sum(-1, keepdim=True) / count) * speech  # noqa: E731
    xc, yc = centre(x), centre(y)
    corr = (xc * yc).sum(-1) / (norm(xc) * norm(yc)).squeeze(-1)  # (B, 15)
    used = (count.squeeze(-1) >= 8).float()  # (B, 1)
    return 1 - (corr * used).sum() / (used.sum() * STOI_BANDS).clamp_min(1)


# ---------------------------------------------------------------------------------------------
# Building and loading
# ---------------------------------------------------------------------------------------------


def n_fft_for(win_length: int) -> int:
    return 1 << (win_length - 1).bit_length()  # as the mel's STFT: next power of two ≥ the window


def htk_mel_filterbank(n_bins: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """(n_bins, n_mels) triangular filters, HTK mel scale from 0 Hz to Nyquist, no norm: the mel of
    `mel_frontend` (torchaudio's melscale_fbanks with those settings; a test holds them equal)."""
    to_mel = lambda hz: 2595.0 * torch.log10(1.0 + hz / 700.0)  # noqa: E731
    bins = torch.linspace(0, sample_rate / 2, n_bins, dtype=torch.float64)
    edges = 700.0 * (10 ** (torch.linspace(0, float(to_mel(torch.tensor(sample_rate / 2.0))), n_mels + 2,
                                           dtype=torch.float64) / 2595.0) - 1.0)  # (n_mels + 2,) Hz
    rise = (bins[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])  # (n_bins, n_mels)
    fall = (edges[None, 2:] - bins[:, None]) / (edges[2:] - edges[1:-1])
    return torch.minimum(rise, fall).clamp_min(0).float()


def build_generator(cfg) -> Generator:
    # exports older than these fields have neither (getattr: a config.yaml read without the Config class)
    return Generator(cfg.n_mels, n_fft_for(cfg.win_length), cfg.hop_length, cfg.dim, cfg.hidden_dim, cfg.layers,
                     cfg.sample_rate, getattr(cfg, "magnitude_prior", False), getattr(cfg, "refine_iters", 0))


def build_discriminators(cfg) -> Discriminators:
    return Discriminators(list(cfg.periods), list(cfg.period_channels), list(cfg.resolutions), cfg.resolution_channels)


def load_vocoder(folder: str | Path, cfg=None):
    """(generator in eval mode, its training config) from a vocoder's final/ (or a checkpoints/step_*/
    folder): `model.safetensors` (the generator) + `config.yaml`. This repository's tools verify the
    folder first (common.training.sealing.resolve_checkpoint) and pass the run's Config as they read it
    (common.config.load_config); without `cfg` (outside this repository, where that class is not),
    config.yaml's values are read as attributes."""
    from safetensors.torch import load_file

    import yaml

    folder = Path(folder)
    if cfg is None:
        cfg = types.SimpleNamespace(**yaml.safe_load((folder / "config.yaml").read_text()))
    generator = build_generator(cfg)
    generator.load_state_dict(load_file(folder / "model.safetensors"))
    return generator.eval(), cfg


def mel_mismatch(vocoder_cfg, tts_cfg) -> str | None:
    """None when the vocoder was trained on the mel the TTS model predicts; else what differs."""
    differ = [f"{k} {getattr(vocoder_cfg, k)} vs {getattr(tts_cfg, k)}" for k in MEL_KEYS
              if getattr(vocoder_cfg, k) != getattr(tts_cfg, k)]
    return ", ".join(differ) or None


@torch.no_grad()
def vocode(generator: Generator, mel: torch.Tensor, refine_iters: int | None = None) -> torch.Tensor:
    """(frames, n_mels) log-mel → (samples,) float32 in [-1, 1]. With `refine_iters` (None: the run's
    `refine_iters`) above 0, `Generator.refine`; 0: the network's own output (what training saw)."""
    if (mel.shape[0] - 1) * generator.hop <= generator.n_fft // 2:  # the STFTs' reflect padding needs more samples
        raise ValueError(f"a mel of {mel.shape[0]} frames is too short to vocode: at least "
                         f"{generator.n_fft // 2 // generator.hop + 2} are needed")
    iters = generator.refine_iters if refine_iters is None else refine_iters
    wav = generator.refine(mel.float()[None], iters) if iters else generator(mel.float()[None])
    return wav[0].clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# The training losses, as train.py composes them, its validation, and a start from another run
# ---------------------------------------------------------------------------------------------


def mel_l1(frontend, wav: torch.Tensor, target_mel: torch.Tensor) -> torch.Tensor:
    """L1 between the log-mel of `wav` (`frontend.differentiable`: the repository's mel front end,
    which train.py builds) and `target_mel`, on HiFi-GAN's scale (log10 amplitude)."""
    return HIFIGAN_MEL_SCALE * torch.mean(torch.abs(frontend.differentiable(wav) - target_mel))


def lsgan_d_loss(discriminator, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """LSGAN discriminator loss on one pass over real and (detached) generated segments."""
    outs = discriminator(torch.cat([real, fake.detach()]))  # one forward: DDP sees one use per step
    n = len(real)
    split = lambda part: [(s[part], [f[part] for f in fs]) for s, fs in outs]  # noqa: E731
    return discriminator_loss(split(slice(None, n)), split(slice(n, None)))


def generator_loss(critic, frontend, real: torch.Tensor, fake: torch.Tensor, mels: torch.Tensor, cfg,
                   adversarial: bool, phase: torch.Tensor | None = None, extra_frontends=()) -> tuple[torch.Tensor, dict]:
    """(generator loss, values to log): mel_loss_weight · L1 mel (the mean over the input mel,
    `frontend`, and the --mel_resolutions mels, `extra_frontends`) (+ sc_loss_weight · spectral
    convergence, + phase_loss_weight · `phase_loss` of the head's `phase`, + envelope_loss_weight ·
    `envelope_loss`), plus (`adversarial`) the LSGAN and fm_loss_weight · feature-matching losses
    through `critic` (the discriminators outside DDP: this backward reaches the generator only)."""
    mel = mel_l1(frontend, fake, mels)
    if extra_frontends:  # each computed on the real segment
        extra = [mel_l1(f, fake, f(real)) for f in extra_frontends]
        mel = (mel + sum(extra)) / (1 + len(extra))
    adv = fm = sc = ph = env = torch.zeros(())
    if cfg.envelope_loss_weight:
        env = envelope_loss(real, fake, cfg.sample_rate)
    if cfg.sc_loss_weight:
        sc = spectral_convergence(real, fake, SC_RESOLUTIONS)
    if cfg.phase_loss_weight:
        ph = phase_loss(real, phase, n_fft_for(cfg.win_length), cfg.hop_length)
    if adversarial:
        with torch.no_grad():
            real_outs = critic(real)
        fake_outs = critic(fake)
        adv, fm = adversarial_loss(fake_outs), feature_matching_loss(real_outs, fake_outs)
    loss = (cfg.mel_loss_weight * mel + cfg.sc_loss_weight * sc + cfg.phase_loss_weight * ph
            + cfg.envelope_loss_weight * env + adv + cfg.fm_loss_weight * fm)
    return loss, {"g_loss": loss, "adv_loss": adv, "fm_loss": fm, "mel_loss": mel,
                  **({"sc_loss": sc} if cfg.sc_loss_weight else {}), **({"phase_loss": ph} if cfg.phase_loss_weight else {}),
                  **({"envelope_loss": env} if cfg.envelope_loss_weight else {})}


@torch.no_grad()
def evaluate(generator, loader, frontend, accelerator) -> dict:
    """Copy-synthesis mel L1 (HiFi-GAN's scale) on whole validation utterances, each once. Collective."""
    generator.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        for wav in batch["wavs"]:
            mel = frontend(wav)
            totals += torch.tensor([mel_l1(frontend, generator(mel[None])[0], mel).item(), 1.0], dtype=torch.float64)
    totals = accelerator.reduce(totals.to(accelerator.device), "sum").cpu()
    generator.train()
    return {"eval_mel_loss": (totals[0] / totals[1]).item()}


def to_image(mel: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """(frames, n_mels) → (n_mels, frames) uint8, low bins at the bottom."""
    return (255 * ((mel.T.flip(0) - lo) / max(hi - lo, 1e-8)).clamp(0, 1)).to(torch.uint8)


@torch.no_grad()
def log_samples(generator, items, rows, frontend, cfg, writer, step: int) -> None:
    """Main process only (no collectives): vocoded audio and real-over-vocoded mel images of the
    validation `rows` (`items.item(row)`), and the recordings once."""
    generator.eval()
    for i, row in enumerate(rows):
        _, wav = items.item(row)
        mel = frontend(wav)
        fake = generator(mel[None])[0].clamp(-1, 1)
        lo, hi = float(mel.min()), float(mel.max())
        image = torch.cat([to_image(mel, lo, hi), to_image(frontend(fake), lo, hi)]).numpy()
        writer.add_image(f"mel/{i}_real_vocoder", image[None], step)
        writer.add_audio(f"audio/{i}", fake[None], step, sample_rate=cfg.sample_rate)
        if step == min(cfg.eval_steps, cfg.max_steps):  # the recordings, once (at the first validation)
            writer.add_audio(f"audio/{i}_recording", wav[None], step, sample_rate=cfg.sample_rate)
    generator.train()


def transfer_from(models: dict, folder: Path, cfg, files: dict[str, Path]) -> str:
    """Initialize the models from another vocoder run (another voice; `folder` verified by the caller):
    each of `files` (model name → its safetensors: a checkpoint's every model, an export's generator
    only; the others start fresh). Refuses another mel or another shape (ValueError, one line).
    Returns a summary line."""
    from safetensors.torch import load_file

    import yaml

    theirs = yaml.safe_load((folder / "config.yaml").read_text())
    differ = [f"{k} {theirs.get(k)} vs {getattr(cfg, k)}" for k in MEL_KEYS if theirs.get(k) != getattr(cfg, k)]
    if differ:
        raise ValueError(f"--init_from {folder}: it was trained on another mel ({', '.join(differ)}): set these to "
                         f"its config.yaml's, or train from scratch")
    if theirs.get("magnitude_prior", False) != cfg.magnitude_prior:  # same shapes, another meaning of the head
        raise ValueError(f"--init_from {folder}: its generator has magnitude_prior {theirs.get('magnitude_prior', False)}, "
                         f"this run {cfg.magnitude_prior}: set --magnitude_prior to its value")
    if not files or not set(files) <= set(models):
        raise ValueError(f"--init_from {folder}: not a vocoder run (its models: {', '.join(files) or 'none named'}): give a vocoder "
                         f"output_dir, its final/ or one of its checkpoints/step_*/ folders")
    taken = []
    for name, path in files.items():
        own = models[name].state_dict()
        state = load_file(path)
        wrong = [f"{k} {tuple(state[k].shape) if k in state else 'missing'} != {tuple(v.shape)}"
                 for k, v in own.items() if k not in state or state[k].shape != v.shape]
        if wrong or len(state) != len(own):
            raise ValueError(f"--init_from {folder}: its {name} has another shape ({'; '.join(wrong[:3]) or 'other keys'}): "
                             f"set the model fields (dim, hidden_dim, layers, periods, ...) to its config.yaml's")
        models[name].load_state_dict(state)
        taken.append(name)
    return (f"initialized from {folder}: {' and '.join(taken)}"
            + ("" if "discriminator" in taken else " (the discriminators start fresh: an export holds the generator "
               "only; give one of its checkpoints/step_*/ folders to take them too)"))
