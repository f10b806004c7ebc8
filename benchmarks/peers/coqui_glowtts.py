"""Coqui TTS's LJSpeech Glow-TTS recipe on one of our voices, for a wall-clock budget (run by Coqui's
own interpreter, for benchmarks/peers/tts.py; never imported by this repository).

    <coqui python> coqui_glowtts.py --data DIR --out DIR --minutes 30 --threads 1 [--language es] [--variant small]

DIR (written by tts.py): train.csv and validation.csv (LJSpeech metadata lines `id|text|text`, our
recipe's split), test.jsonl ({"id", "text"} per held-out sentence) and wavs/ (the voice's audio).
The model and trainer are built as Coqui's recipes/ljspeech/glow_tts/train_glowtts.py builds them:
GlowTTSConfig with the recipe's values (batch 32, evaluation every epoch, phonemes through
espeak-ng), `load_tts_samples`, `Trainer(...)` (in coqui-tts 0.28 the model builds its tokenizer and
audio processor from the config itself, which the recipe did by hand). Changed, and why:
the validation split is ours (the recipe draws a random one from the training list), the phoneme
language and cleaner (the recipe's are English; `multilingual_phoneme_cleaners` is Coqui's own for
other languages), audio resampled on load to their 22 050 Hz (our prompts are 16 kHz: our recipe
resamples too), no test sentences synthesized after every epoch (the recipe's English defaults,
Griffin-Lim on the training process's time), fp32 and no loader worker processes (one CPU thread).

Their learning rate, as shipped: the Noam schedule's 4000 warm-up steps are counted in epochs (the
trainer's `scheduler_after_epoch` default), and coqui-tts-trainer 0.4.0 never steps an epoch-stepped
scheduler of a model with one optimizer (it records the optimizer as index None and looks for index 0
at the epoch's end), so the recipe trains at 1e-3 x 4000^-1 = 2.5e-7 for ever (its log's
`current_lr`). `--variant small` is the recipe at our model's size and warm-up (as
benchmarks/peers/asr.py's SpeechBrain "small" is) with the two things that keep it from training here
worked around. Size: encoder 6 -> 3 layers (its width 192 and feed-forward 768 are ours), decoder
12 -> 4 flows of 192 -> 128 channels: 7.30 M parameters against our 6.96 M (the recipe's 28.6 M).
Warm-up: 100 optimizer steps (ours), the scheduler stepped per optimizer step (`scheduler_after_epoch`
False, a path the trainer does step). And the mel's upper edge at the recordings' Nyquist frequency
when it is below theirs (8 kHz for 16-kHz prompts; the recipe's 11 025 Hz): above it resampled
recordings carry no energy, their mel channels are constant (7 of 80 on the Spanish prompts) and
Glow-TTS's data-dependent ActNorm initialization divides by that zero spread: the log-likelihood
starts at ~1e14 and does not recover.
At the budget the training stops after the step in flight; the model as it is then synthesizes every
test sentence with Coqui's own `synthesize(..., use_griffin_lim=True)` (their Griffin-Lim, 60
iterations), written as wavs/<id>.wav under --out, and result.json says how far it got.
"""

import argparse
import json
import os
import time
from pathlib import Path


class BudgetSpent(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, required=True, help="wall minutes since this process started")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--language", default="es", help="espeak-ng voice of the phonemizer")
    parser.add_argument("--variant", choices=["shipped", "small"], default="shipped",
                        help="shipped: the recipe's model; small: at our size and warm-up (module docstring)")
    args = parser.parse_args()
    t0 = float(os.environ.get("PEER_T0", time.time()))  # the launch (tts.py sets it): start-up counts
    deadline = t0 + 60 * args.minutes

    import soundfile as sf
    import torch
    import trainer as coqui_trainer
    from trainer import Trainer, TrainerArgs
    from TTS.tts.configs.glow_tts_config import GlowTTSConfig
    from TTS.tts.configs.shared_configs import BaseDatasetConfig
    from TTS.tts.datasets import load_tts_samples
    from TTS.tts.models.glow_tts import GlowTTS

    torch.set_num_threads(args.threads)
    data, out = Path(args.data).resolve(), Path(args.out).resolve()
    dataset = BaseDatasetConfig(formatter="ljspeech", meta_file_train="train.csv", meta_file_val="validation.csv",
                                path=str(data))
    config = GlowTTSConfig(  # the recipe's values, then what is changed (module docstring)
        batch_size=32, eval_batch_size=16, num_loader_workers=0, num_eval_loader_workers=0, run_eval=True,
        test_delay_epochs=-1, epochs=1000, text_cleaner="multilingual_phoneme_cleaners", use_phonemes=True,
        phoneme_language=args.language, phoneme_cache_path=str(out / "phoneme_cache"), print_step=25,
        print_eval=False, mixed_precision=False, output_path=str(out / "coqui"), datasets=[dataset],
        test_sentences=[])
    if args.variant == "small":
        config.encoder_params["num_layers"] = 3
        config.num_flow_blocks_dec, config.hidden_channels_dec = 4, 128
        config.lr_scheduler_params, config.scheduler_after_epoch = {"warmup_steps": 100}, False
        nyquist = min(sf.info(str(f)).samplerate for f in (data / "wavs").iterdir()) / 2
        if nyquist < config.audio.sample_rate / 2:
            config.audio.mel_fmax = nyquist
    config.audio.resample = True
    model = GlowTTS(config)  # coqui-tts 0.28 builds its tokenizer and audio processor from the config
    ap = model.ap
    train_samples, eval_samples = load_tts_samples(model.config, eval_split=True)
    trainer = Trainer(TrainerArgs(), model.config, str(out / "coqui"), model=model, train_samples=train_samples,
                      eval_samples=eval_samples)

    step_once = coqui_trainer.Trainer.train_step

    def train_step(self, *a, **k):
        result = step_once(self, *a, **k)
        if time.time() >= deadline:
            raise BudgetSpent
        return result

    coqui_trainer.Trainer.train_step = train_step
    try:
        trainer._fit()  # fit() without its handlers: they delete the run folder on any exception
        stopped = "epochs done"
    except BudgetSpent:
        stopped = "budget"
    minutes = (time.time() - t0) / 60
    model.eval()
    (out / "wavs").mkdir(exist_ok=True)
    with torch.no_grad():
        for line in (data / "test.jsonl").read_text().splitlines():
            row = json.loads(line)
            wav = model.synthesize(row["text"], use_griffin_lim=True)["wav"]
            sf.write(out / "wavs" / f"{row['id']}.wav", wav, ap.sample_rate, subtype="PCM_16")
    (out / "result.json").write_text(json.dumps({
        "stopped": stopped, "minutes": round(minutes, 3), "optimizer_steps": trainer.total_steps_done,
        "epochs": trainer.epochs_done, "sample_rate": ap.sample_rate,
        "parameters": sum(p.numel() for p in model.parameters()), "variant": args.variant}, indent=1))


if __name__ == "__main__":
    main()
