"""Tools load a trained model only from a folder sealed as training wrote it (COMPLETE marker, every
file's digest), say what is wrong in one line (exit code 2) otherwise, and never import the code an
export carries for use outside the repository. The exports here are built by hand (tiny, untrained,
sealed the way `export_final` seals them): each refusal comes before any training would matter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from safetensors.torch import save_file

from common.training.sealing import MARKER, seal_files
from common.config import config_to_dict
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import ROOT, python

tts = recipe_modules("tts", "model")
vocoder = recipe_modules("vocoder", "model")



def full(recipe: str, **values) -> dict:
    """A config.yaml's values as training writes them: every field of the recipe's Config."""
    return config_to_dict(recipe_modules(recipe, "train").train.Config(**values))


MEL = dict(sample_rate=22050, n_mels=80, win_length=1024, hop_length=256)
TTS_CFG = full("tts", **MEL, symbols=" abcdefghijklmnopqrstuvwxyz'.,;:?!-\"()", dim=16, encoder_layers=1,
               decoder_layers=1, num_heads=2, ffn_dim=32, conv_kernel=3, dropout=0.0, duration_channels=16,
               attention_dim=16, attention_temperature=0.0005, blank_logprob=-1.0)
VOCODER_CFG = full("vocoder", **MEL, dim=8, hidden_dim=16, layers=1)
FOR_TTS_RUN = {"max_seconds": TTS_CFG["max_seconds"]}  # what --tts_run takes from TTS_CFG's run that is not a default of both


def seal(folder: Path) -> Path:
    (folder / MARKER).write_text(json.dumps({"export": True, "files": seal_files(folder)}))
    return folder


def export(folder: Path, cfg: dict, weights: dict, **files: str) -> Path:
    """A final/ as `export_final` writes it: weights, config.yaml, `files`, then the marker."""
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return seal(folder)


def tool(script: str, *args) -> subprocess.CompletedProcess:
    """`script` as a user runs it: its own process (forked, tests/harness/harness.py)."""
    return python([ROOT / "recipes" / script, *args])


@pytest.fixture
def in_process(monkeypatch, capsys):
    """`script`'s main() with `args` in this process (the same code path as `tool`, without a
    second torch start-up): → a CompletedProcess of its exit code and stderr."""

    def call(script: str, *args) -> subprocess.CompletedProcess:
        recipe, name = script.removesuffix(".py").split("/")
        module = getattr(recipe_modules(recipe, name), name)
        monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
        capsys.readouterr()
        try:
            module.main()
            code = 0
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return call


def one_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit code 2 and one line on stderr holding each of `expected`: no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


@pytest.fixture
def tts_run(tmp_path) -> Path:
    import torch

    torch.manual_seed(0)
    out = tmp_path / "tts"
    model = tts.model.build_model(SimpleNamespace(**TTS_CFG))
    export(out / "final", TTS_CFG, model.state_dict(), **{"symbols.json": json.dumps({"symbols": TTS_CFG["symbols"]})})
    return out


@pytest.fixture
def vocoder_run(tmp_path) -> tuple[Path, Path]:
    """A vocoder final/ whose vocoder_model.py (the copy for use outside the repository) also
    leaves a file behind when it is executed."""
    ran = tmp_path / "vocoder_model_ran"
    code = (ROOT / "recipes" / "vocoder" / "model.py").read_text() + f"\nopen({str(ran)!r}, 'w').write('executed')\n"
    generator = vocoder.model.build_generator(SimpleNamespace(**VOCODER_CFG))
    out = tmp_path / "vocoder"
    export(out / "final", VOCODER_CFG, generator.state_dict(), **{"vocoder_model.py": code})
    return out, ran


def test_synthesize_never_imports_the_vocoder_exports_code(tts_run, vocoder_run, tmp_path, in_process):
    """The vocoder's code comes from this repository: the export's copy is not executed, sealed or
    not; a folder whose marker was removed is refused before anything in it is read."""
    vocoder_out, ran = vocoder_run
    wav = tmp_path / "out.wav"
    proc = in_process("tts/synthesize.py", "--checkpoint", tts_run, "--vocoder", vocoder_out, "--text", "a radio", "--output", wav)
    assert proc.returncode == 0, proc.stderr
    assert wav.stat().st_size > 44 and not ran.exists()
    (vocoder_out / "final" / MARKER).unlink()
    proc = in_process("tts/synthesize.py", "--checkpoint", tts_run, "--vocoder", vocoder_out, "--text", "a radio", "--output", wav)
    one_line(proc, f"--vocoder {vocoder_out / 'final'}: no COMPLETE marker", "re-run the training command")
    assert not ran.exists()


def test_synthesize_takes_the_tts_runs_own_vocoder_by_default_else_griffin_lim_and_says_which(tts_run, tmp_path,
                                                                                               in_process):
    """--vocoder auto (the default): Griffin-Lim while the TTS run has no vocoder/ (a line says so and how to
    train it); once <run>/vocoder is there, that vocoder (a line names it): the same audio as --vocoder
    naming it, another than --vocoder griffin_lim's."""
    def speak(*args) -> tuple[subprocess.CompletedProcess, bytes]:
        wav = tmp_path / f"{len(list(tmp_path.glob('*.wav')))}.wav"
        proc = in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text", "a radio", "--output", wav, *args)
        assert proc.returncode == 0, proc.stderr
        return proc, wav.read_bytes()

    proc, _ = speak()
    assert (f"--vocoder auto: Griffin-Lim ({tts_run} has no vocoder/); the voice's own neural vocoder sounds better "
            f"(PESQ, MCD): train it with `accelerate launch recipes/vocoder/train.py --tts_run {tts_run}`") in proc.stdout
    generator = vocoder.model.build_generator(SimpleNamespace(**VOCODER_CFG))
    export(tts_run / "vocoder" / "final", {**VOCODER_CFG, **FOR_TTS_RUN}, generator.state_dict(),
           **{"vocoder_model.py": "raise SystemExit"})
    proc, auto = speak()
    assert f"--vocoder auto: the voice's own vocoder, {tts_run / 'vocoder'} (--vocoder griffin_lim:" in proc.stdout
    assert auto == speak("--vocoder", tts_run / "vocoder")[1]
    proc, griffin_lim = speak("--vocoder", "griffin_lim")
    assert griffin_lim != auto and "--vocoder auto" not in proc.stdout


def test_a_tts_runs_vocoder_unfinished_damaged_or_of_other_data_is_refused_not_replaced(tts_run, tmp_path, in_process):
    """A <run>/vocoder that --vocoder auto cannot use is refused in one line with what to do, never
    replaced by Griffin-Lim unasked."""
    said = lambda: in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text", "a radio",  # noqa: E731
                              "--output", tmp_path / "a.wav")
    own = tts_run / "vocoder"
    (own / "checkpoints").mkdir(parents=True)  # a vocoder training that has not exported yet
    one_line(said(), f"--vocoder auto: the TTS run's vocoder {own}: this run has no final/ yet",
             "(--vocoder griffin_lim: Griffin-Lim meanwhile)")
    generator = vocoder.model.build_generator(SimpleNamespace(**VOCODER_CFG))
    export(own / "final", {**VOCODER_CFG, **FOR_TTS_RUN, "num_test": 53}, generator.state_dict(), **{"vocoder_model.py": ""})
    one_line(said(), f"--vocoder auto: {own} was trained on other data than this TTS model (num_test 53 vs 20): train it "
             f"again for this run (`accelerate launch recipes/vocoder/train.py --tts_run {tts_run} --resume false`), "
             f"or give --vocoder griffin_lim")
    (own / "final" / MARKER).unlink()
    one_line(said(), f"--vocoder auto: the TTS run's vocoder {own / 'final'}: no COMPLETE marker")
    assert not (tmp_path / "a.wav").exists()


def test_synthesize_refuses_unknown_symbols_an_unwritable_output_and_an_unsealed_model(tts_run, tmp_path, in_process):
    one_line(in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text", "room 42", "--output", tmp_path / "a.wav"),
             "--text: characters outside the symbol table: '24'", "this model's symbols:")
    lines = tmp_path / "lines.txt"
    lines.write_text("a radio\n\nroom 42\n")
    one_line(in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text_file", lines, "--output_dir", tmp_path / "wavs"),
             f"--text_file {lines} line 3: characters outside the symbol table")  # the file's line
    assert not (tmp_path / "wavs").exists() and not (tmp_path / "a.wav").exists()  # refused before writing anything
    (tmp_path / "a_file").write_text("")
    one_line(in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text", "a radio", "--output", tmp_path / "a_file" / "x.wav"),
             f"--output {tmp_path / 'a_file' / 'x.wav'}: cannot write there")
    one_line(in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text", "a radio", "--output", tmp_path),
             f"--output {tmp_path} is a folder")
    (tts_run / "final" / "symbols.json").write_text(json.dumps({"symbols": TTS_CFG["symbols"] + "42"}))
    one_line(in_process("tts/synthesize.py", "--checkpoint", tts_run, "--text", "room 42", "--output", tmp_path / "a.wav"),
             f"--checkpoint {tts_run / 'final'}: damaged (symbols.json has")


ASR_CFG = full("asr", data_dir="data", n_mels=80, stack_frames=4)


@pytest.mark.parametrize("damage", ["no marker", "config edited", "vocab edited", "half-written weights",
                                    "weights cut, no marker", "file added"])
def test_decode_refuses_an_unsealed_or_edited_final_in_one_line(tmp_path, damage, in_process):
    """Whatever was done to final/ after training sealed it: one line naming it, exit code 2, and
    nothing of it read (an edited config.yaml would point decoding at another data_dir)."""
    final = tmp_path / "asr" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"\0" * 4096)
    (final / "config.yaml").write_text(yaml.safe_dump(ASR_CFG))
    (final / "vocab.json").write_text(json.dumps({"<blank>": 0, "a": 1}))
    seal(final)
    expected = "damaged"
    if damage == "no marker":
        (final / MARKER).unlink()
        expected = "no COMPLETE marker"
    elif damage == "config edited":
        with open(final / "config.yaml", "a") as f:
            f.write("data_dir: /etc\n")
        expected = "damaged (config.yaml has"
    elif damage == "vocab edited":
        (final / "vocab.json").write_text(json.dumps({"<blank>": 0, "b": 1}))
        expected = "damaged (vocab.json is corrupted (digest mismatch))"
    elif damage == "half-written weights":
        (final / "model.safetensors").write_bytes(b"\0" * 1000)
        expected = "damaged (model.safetensors has 1000 bytes, 4096 were written)"
    elif damage == "weights cut, no marker":
        (final / "model.safetensors").write_bytes(b"\0" * 1000)
        (final / MARKER).unlink()
        expected = "no COMPLETE marker"
    else:
        (final / "tokenizer.py").write_text("import os\n")
        expected = "tokenizer.py is not covered by its COMPLETE marker"
    run = tool if damage == "config edited" else in_process  # one as a user runs it: a process of its own
    one_line(run("asr/decode.py", "--checkpoint", tmp_path / "asr", "--split", "test"),
             f"--checkpoint {final}: {expected}")


def test_decode_of_a_step_folder_copied_out_of_its_run_says_what_it_needs(tmp_path, in_process):
    step = tmp_path / "copied" / "step_00000004"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"\0" * 64)
    (step / "config.yaml").write_text(yaml.safe_dump(ASR_CFG))
    seal(step)
    one_line(in_process("asr/decode.py", "--checkpoint", step, "--split", "test"),
             f"--checkpoint {step}: no tokenizer for it at {tmp_path}/tokenizer/tokenizer.json",
             "give the run's output_dir or its final/")


def test_a_tts_export_loads_outside_the_repository_through_import_export(tmp_path, monkeypatch):
    """The model card's way: `import_export` verifies final/, imports tts_model (and the tts_frontend
    it imports) from the sealed source, and synthesizes what the recipe's own code does from it."""
    import re

    import torch

    from common.training.sealed_import import import_export

    local = ("model", "audio", "frontend")  # renamed as the TTS recipe's export renames them
    code = {}
    for name in local:
        text = (ROOT / "recipes" / "tts" / f"{name}.py").read_text()
        for other in local:
            text = re.sub(rf"^from {other} import", f"from tts_{other} import", text, flags=re.M)
        code[f"tts_{name}.py"] = text
    torch.manual_seed(0)
    model = tts.model.build_model(SimpleNamespace(**TTS_CFG))
    final = export(tmp_path / "final", TTS_CFG, model.state_dict(),
                   **{"symbols.json": json.dumps({"symbols": TTS_CFG["symbols"]})}, **code)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in local:
        monkeypatch.delitem(sys.modules, f"tts_{name}", raising=False)
    exported = import_export(final, "tts_model")
    assert Path(exported.__file__) == final / "tts_model.py" and not (final / "__pycache__").exists()
    theirs, cfg, symbols, _ = exported.load_tts(final)
    ours, _, _, _ = tts.model.load_tts(final, SimpleNamespace(**TTS_CFG))
    text = "a radio wrote this"
    assert torch.equal(exported.synthesize(theirs, symbols, text)[1], tts.model.synthesize(ours, symbols, text)[1])


def test_export_py_writes_a_sealed_folder_that_the_tools_accept(tmp_path, in_process):
    """export.py on a step folder: its output carries a COMPLETE marker like a training final/, so
    decode.py (and every tool) accepts it; the weights are the checkpoint's."""
    import torch

    from common.training.sealing import resolve_checkpoint
    from common.model.encoder import encoder_config_from
    from common.model.hf_export import load_recipe_ctc_weights

    asr = recipe_modules("asr", "model", "text")
    cfg = dict(ASR_CFG, sample_rate=16000, hidden_size=16, num_layers=1, num_heads=2, ffn_dim=32, conv_kernel=3,
               dropout=0.0)
    run_dir = tmp_path / "asr"
    tokenizer = asr.text.CharTokenizer()
    (run_dir / "tokenizer").mkdir(parents=True)
    tokenizer.save(run_dir / "tokenizer")
    torch.manual_seed(0)
    model = asr.model.ConformerCTC(encoder_config_from(SimpleNamespace(**cfg)), n_mels=80, stack_frames=4,
                                   vocab_size=tokenizer.vocab_size)
    step = export(run_dir / "checkpoints" / "step_00000004", cfg, model.state_dict())
    out = tmp_path / "exported"
    proc = in_process("asr/export.py", "--checkpoint", step, "--output_dir", out)
    assert proc.returncode == 0, proc.stderr
    assert resolve_checkpoint(out) == out and (out / "tokenizer" / "tokenizer.json").is_file()
    theirs = load_recipe_ctc_weights(out)
    assert all(torch.equal(theirs[k], v) for k, v in model.state_dict().items())
    assert not list(tmp_path.glob(".exported*"))  # written aside, renamed into place


def test_tools_read_a_runs_config_as_its_config_class(tmp_path, in_process):
    """A config.yaml written before some settings existed is read with their defaults (one log line
    naming them); one holding a key the recipe's Config does not have (a newer version, another
    recipe) is refused in one line, not silently dropped."""
    import torch

    torch.manual_seed(0)
    model = tts.model.build_model(SimpleNamespace(**TTS_CFG))
    table = {"symbols.json": json.dumps({"symbols": TTS_CFG["symbols"]})}
    older = {k: v for k, v in TTS_CFG.items() if k != "num_samples"}
    export(tmp_path / "older" / "final", older, model.state_dict(), **table)
    proc = in_process("tts/synthesize.py", "--checkpoint", tmp_path / "older", "--text", "a radio",
                      "--output", tmp_path / "a.wav", "--griffin_lim_iters", "1")
    assert proc.returncode == 0 and (tmp_path / "a.wav").is_file(), proc.stderr
    assert "written before 1 setting(s) existed; they take their defaults: num_samples=" in proc.stderr

    export(tmp_path / "newer" / "final", dict(TTS_CFG, pitch_predictor=True), model.state_dict(), **table)
    one_line(in_process("tts/synthesize.py", "--checkpoint", tmp_path / "newer", "--text", "a radio",
                        "--output", tmp_path / "b.wav"),
             "'pitch_predictor' is not a setting of train.Config: written by a newer version")
    assert not (tmp_path / "b.wav").exists()


# A fresh interpreter (-I: no PYTHONPATH, no script or working folder on sys.path) that cannot import
# this repository, even where an older editable install of it is still in site-packages.
WITHOUT_THE_REPOSITORY = """
import importlib.abc, sys

class NotHere(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("common", "tools", "recipes", "tests"):
            raise ImportError(f"{name}: this repository's, not importable here")

sys.meta_path.insert(0, NotHere())
"""


def test_tts_and_vocoder_exports_load_without_the_repository(tmp_path):
    """final/ as training writes its code (common.model.hf_export.write_code with the recipes' lists), copied
    into an empty folder, loads and runs in a fresh interpreter with only installed packages: the
    TTS synthesizes what the recipe's own code does, the vocoder vocodes."""
    import torch

    from common.model.hf_export import write_code

    torch.manual_seed(0)
    model = tts.model.build_model(SimpleNamespace(**TTS_CFG))
    tts_final = export(tmp_path / "tts", TTS_CFG, model.state_dict(),
                       **{"symbols.json": json.dumps({"symbols": TTS_CFG["symbols"]})})
    write_code(tts_final, "tts", recipe_modules("tts", "train").train.exported_code())
    generator = vocoder.model.build_generator(SimpleNamespace(**VOCODER_CFG))
    voc_final = export(tmp_path / "vocoder", VOCODER_CFG, generator.state_dict())
    write_code(voc_final, "vocoder", {"model": ROOT / "recipes" / "vocoder" / "model.py"})
    empty = tmp_path / "empty"
    empty.mkdir()
    script = WITHOUT_THE_REPOSITORY + f"""
import torch
sys.path.insert(0, {str(tts_final)!r})
sys.path.insert(0, {str(voc_final)!r})
import tts_audio, tts_model, vocoder_model
model, cfg, symbols, _ = tts_model.load_tts({str(tts_final)!r})
_, mel, _ = tts_model.synthesize(model, symbols, "a radio", tts_audio.make_vocoder(cfg, n_iter=1))
torch.save(mel, "mel.pt")
generator, vcfg = vocoder_model.load_vocoder({str(voc_final)!r})
wav = vocoder_model.vocode(generator, mel)
assert wav.ndim == 1 and len(wav) > 0 and vcfg.n_mels == cfg.n_mels
"""
    proc = subprocess.run([sys.executable, "-I", "-c", script], cwd=empty, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, _, _, _ = tts.model.load_tts(tts_final, SimpleNamespace(**TTS_CFG))
    syn = recipe_modules("tts", "audio", "model")
    _, mel, _ = syn.model.synthesize(ours, syn.model.Symbols.from_config(SimpleNamespace(**TTS_CFG)), "a radio",
                                     syn.audio.make_vocoder(SimpleNamespace(**TTS_CFG), n_iter=1))
    assert torch.equal(torch.load(empty / "mel.pt"), mel)
    assert sorted(p.name for p in empty.iterdir()) == ["mel.pt"]
