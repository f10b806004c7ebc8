"""Speaker identification (recipes/speaker_id, a copy of best_rq adapted to another task: docs/adapt.md):
its held-out utterances, its new fields' help and refusals, and predict.py. Its kill and resume in 1 and 2
processes is the test every recipe without one of its own gets (tests/guarantees/test_every_recipe.py), as a
copy would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.data.manifest import read_librispeech
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import ROOT, last_flag_wins

SEED = 42
HELD_OUT = 0.25  # of the tiny corpus's 48 training utterances: enough to validate on
TINY = ["--hidden_size", "32", "--num_layers", "1", "--num_heads", "2", "--ffn_dim", "64", "--conv_kernel", "7",
        "--warmup_steps", "5", "--logging_steps", "1", "--eval_steps", "4", "--report_to", "none",
        "--seed", str(SEED), "--heldout_fraction", str(HELD_OUT)]
SCRIPT = ROOT / "recipes" / "speaker_id" / "train.py"

speaker_id = recipe_modules("speaker_id", "data")


def args_for(corpus: Path, out: Path, *extra: str) -> list[str]:
    return last_flag_wins(["--data_dir", str(corpus / "librispeech"), "--output_dir", str(out), *TINY, *extra])


def test_the_held_out_utterances_are_a_function_of_their_ids(tiny_corpus):
    ids = read_librispeech(tiny_corpus / "librispeech", "train")["id"]
    held = [i for i in ids if speaker_id.data.held_out(i, HELD_OUT)]
    assert held == [i for i in reversed(ids) if speaker_id.data.held_out(i, HELD_OUT)][::-1]  # order-free
    assert 0 < len(held) < len(ids) / 2
    assert set(held) <= {i for i in ids if speaker_id.data.held_out(i, 2 * HELD_OUT)}  # nested


def test_help_lists_the_new_fields_and_a_bad_value_is_one_line():
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--heldout_fraction" in help_text.stdout
    assert "--speaker_column_name" in help_text.stdout
    for argv, message in ((["--heldout_fraction", "1"], "error: --heldout_fraction: must be in (0, 1), got 1.0"),
                          (["--speaker_column_name", "spk"], "error: --speaker_column_name applies to a "
                                                             "--dataset_name source; give --dataset_name, or drop it")):
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stderr.splitlines()) == (2, [message]), proc.stderr


def test_an_audiofolder_names_the_speakers_or_the_run_says_it_needs_them(tmp_path):
    """--data_dir <folder>/train/metadata.csv: its speaker column is the label; without one every
    utterance is the folder's voice, and a one-speaker run is refused in one line (not trained)."""
    import numpy as np
    import soundfile as sf
    from accelerate import Accelerator

    from common.config import parse_config
    from common.training.faults import UsageError

    train = recipe_modules("speaker_id", "train").train
    split = tmp_path / "voices" / "train"
    split.mkdir(parents=True)
    for i in range(12):
        sf.write(split / f"u{i:02d}.wav", np.sin(np.arange(12000) * (0.05 + 0.01 * (i % 2))).astype("float32"), 16000)
    for header, rows, message in (("speaker", [f"s{i % 2}" for i in range(12)], None),
                                  ("text", ["words"] * 12, "the training split has 1 speaker (train): identification")):
        (split / "metadata.csv").write_text(f"file_name,{header}\n" + "".join(f"u{i:02d}.wav,{r}\n" for i, r in enumerate(rows)))
        cfg = parse_config(train.Config, ["--data_dir", str(tmp_path / "voices"), "--heldout_fraction", "0.5",
                                          "--output_dir", str(tmp_path / header)],
                           default_yaml=ROOT / "recipes" / "speaker_id" / "config.yaml")
        build = lambda: train.build_data(cfg, Accelerator(cpu=True), tmp_path / header, global_batch=1, num_workers=0)  # noqa: E731
        if message is None:
            assert build().train_items.speakers == ["s0", "s1"]
            continue
        with pytest.raises(UsageError) as e:
            build()
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.slow
def test_predict_names_a_training_speaker_per_file(tiny_corpus, tmp_path, reference):
    """predict.py --audio on held-out utterances, a stereo copy of one and a 44.1 kHz one: the
    probabilities are those of the classifier on the training data path (FeatureDataset and
    PaddingCollator, one utterance per batch), top_k of them most probable first, in stdout and
    --output alike; a step folder (no speakers.json) is refused in one line."""
    import json

    import numpy as np
    import soundfile as sf
    import torch
    import torchaudio

    from common.config import load_config
    from common.training.averaging import checkpoint_weights
    from common.model.encoder import encoder_config_from
    from tests.harness.harness import python

    out = reference("speaker_id", 1, lambda o: args_for(tiny_corpus, o, "--max_steps", "2", "--save_steps", "2",
                                                         "--eval_steps", "0"))
    rows = read_librispeech(tiny_corpus / "librispeech", "validation")
    files = list(rows["path"])[:3]
    mono, rate = sf.read(files[0], dtype="float32")
    sf.write(tmp_path / "stereo.wav", np.stack([mono, mono], axis=1), rate, subtype="FLOAT")  # reads as files[0]
    sf.write(tmp_path / "44k.wav", torchaudio.functional.resample(torch.from_numpy(mono), rate, 44100).numpy(), 44100)
    files += [str(tmp_path / "stereo.wav"), str(tmp_path / "44k.wav")]
    script = ROOT / "recipes" / "speaker_id" / "predict.py"
    proc = python([script, "--checkpoint", out, "--audio", *files, "--top_k", "3", "--output", tmp_path / "p.jsonl"],
                  stderr_to_stdout=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    written = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    printed = [line.split("\t") for line in proc.stdout.splitlines() if "\t" in line]
    assert [r["path"] for r in written] == [p for p, *_ in printed] == files
    assert [[f"{s}:{p:.4f}" for s, p in r["speakers"]] for r in written] == [ranked for _, *ranked in printed]

    speakers = json.loads((out / "final" / "speakers.json").read_text())
    modules = recipe_modules("speaker_id", "data", "model", "train")
    cfg = load_config(out / "final", modules.train.Config)
    model = modules.model.SpeakerClassifier(encoder_config_from(cfg), n_mels=cfg.n_mels, stack_frames=cfg.stack_frames,
                                            num_speakers=len(speakers)).eval()
    model.load_state_dict(checkpoint_weights(out / "final"))
    items = modules.data.FeatureDataset(rows, cfg.sample_rate, cfg.n_mels, speakers)
    for i, row in enumerate(written[:3]):
        batch = modules.data.PaddingCollator(cfg)([items[i]])
        with torch.no_grad():
            probs = model.logits(batch["feats"], batch["feat_lens"]).softmax(-1)[0]
        top = probs.topk(3)
        assert [s for s, _ in row["speakers"]] == [speakers[k] for k in top.indices.tolist()]
        assert [p for _, p in row["speakers"]] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert written[3]["speakers"] == written[0]["speakers"]  # the stereo copy (equal channels)

    step = python([script, "--checkpoint", out / "checkpoints" / "step_00000002", "--audio", files[0]],
                  stderr_to_stdout=True)
    assert step.returncode == 2 and step.stdout.strip().splitlines()[-1].endswith(
        f"error: --checkpoint {out / 'checkpoints' / 'step_00000002'}: no speakers.json (the names of the classifier's "
        f"outputs, written into final/ at the end of training): give the run's output_dir or its final/"), step.stdout
