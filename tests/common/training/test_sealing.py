"""Sealed folders (common/training/sealing.py): what `resolve_checkpoint` accepts and refuses, malformed
markers, and the entries a sealed folder may hold."""

import json
import os
import shutil

import pytest

from common.training.sealing import verify_checkpoint


def seal(folder, files: dict[str, str | bytes]):
    """`folder` with `files` in it, sealed as `export_final` seals a final/ (a COMPLETE marker)."""
    from common.training.sealing import MARKER, seal_files

    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (folder / MARKER).write_text(json.dumps({"export": True, "files": seal_files(folder)}))
    return folder


def test_resolve_checkpoint_accepts_output_dir_final_or_step(tmp_path):
    from common.training.sealing import resolve_checkpoint
    from common.training.faults import UsageError

    for folder in (tmp_path / "final", tmp_path / "checkpoints" / "step_00000001"):
        seal(folder, {"model.safetensors": "x", "config.yaml": "a: 1\n"})
    assert resolve_checkpoint(tmp_path) == tmp_path / "final"
    assert resolve_checkpoint(tmp_path / "final") == tmp_path / "final"
    assert resolve_checkpoint(tmp_path / "checkpoints" / "step_00000001") == tmp_path / "checkpoints" / "step_00000001"
    with pytest.raises(UsageError, match="--checkpoint .*checkpoints: no trained model in it"):
        resolve_checkpoint(tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "final")
    with pytest.raises(UsageError, match="this run has no final/ yet .*give one of its checkpoints/step_\\*/"):
        resolve_checkpoint(tmp_path)


def test_an_unfinished_unsealed_or_damaged_export_is_refused(tmp_path):
    """`.final.tmp/` without `final/` (a kill during the export); a `final/` without its marker
    (whatever its files hold: a half-written model, an edited config); a sealed one whose files
    differ from the marker, or that holds a file the marker does not list: each refused in one line
    naming the folder, by every tool (`--checkpoint`, `--init_from`), before any of its files is read."""
    from common.training.sealing import MARKER, resolve_checkpoint
    from common.model.hf_encoder import pretrained_folder
    from common.training.faults import UsageError

    out = tmp_path / "run"
    (out / ".final.tmp").mkdir(parents=True)
    (out / ".final.tmp" / "model.safetensors").write_bytes(b"x")
    for resolve, flag in ((resolve_checkpoint, "--checkpoint"), (pretrained_folder, "--init_from")):
        with pytest.raises(UsageError, match=f"{flag} .*the export of this run did not finish.*re-run the training"):
            resolve(out)
    final = seal(out / "final", {"model.safetensors": "weights", "config.yaml": "data_dir: data\n",
                                 "tokenizer/vocab.json": "{}"})
    assert resolve_checkpoint(out) == final
    (final / "__pycache__").mkdir()
    (final / "__pycache__" / "x.pyc").write_bytes(b"Python writes these beside imported code")
    assert resolve_checkpoint(out) == final

    def refused(flag="--checkpoint", resolve=resolve_checkpoint):
        with pytest.raises(UsageError) as e:
            resolve(out)
        assert str(e.value).startswith(f"{flag} {final}: ") and "\n" not in str(e.value)
        return str(e.value)

    (final / "config.yaml").write_text("data_dir: /etc/x\n")  # edited
    assert "damaged (config.yaml has 17 bytes, 15 were written)" in refused()
    (final / "config.yaml").write_text("data_dir: /etc\n")  # edited, same size
    assert "damaged (config.yaml is corrupted (digest mismatch))" in refused("--init_from", pretrained_folder)
    (final / "config.yaml").write_text("data_dir: data\n")
    (final / "tokenizer" / "vocab.json").write_text("{ }")
    assert "tokenizer/vocab.json has 3 bytes" in refused()
    (final / "tokenizer" / "vocab.json").write_text("{}")
    (final / "extra.py").write_text("print('not sealed')")
    assert "extra.py is not covered by its COMPLETE marker (added after the folder was sealed)" in refused()
    (final / "extra.py").unlink()
    assert resolve_checkpoint(out) == final
    (final / MARKER).unlink()  # a marker-less final/, whatever it holds
    message = refused()
    assert "no COMPLETE marker" in message and "re-run the training command that made it" in message
    assert "no COMPLETE marker" in refused("--init_from", pretrained_folder)


MALFORMED_MARKERS = {  # COMPLETE's text → what verify_checkpoint says of it
    "no sha256": ('{"files": {"config.yaml": {"bytes": 5}}}', "entry 'config.yaml' has no sha256 digest"),
    "int entry": ('{"files": {"config.yaml": 5}}', "entry 'config.yaml' has no byte count"),
    "bool bytes": ('{"files": {"config.yaml": {"bytes": true, "sha256": "%s"}}}' % ("0" * 64),
                   "entry 'config.yaml' has no byte count"),
    "files a list": ('{"files": ["config.yaml"]}', "files is a list, not an object"),
    "no files": ('{"step": 1}', "no files object"),
    "a list": ("[]", "a JSON list, not an object"),
    "nested": ("[" * 200_000, "not JSON: nested too deeply"),
    "outside": ('{"files": {"../x": {"bytes": 1, "sha256": "%s"}}}' % ("0" * 64),
                "entry '../x' is not a file inside the folder"),
    "step": ('{"step": "2", "files": {}}', "step '2' is not a step count"),
    "binary": (b"\xff\xfe{", "not JSON"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED_MARKERS))
def test_a_malformed_marker_is_a_damaged_folder(tmp_path, kind):
    """Every malformed COMPLETE marker is said as one reason (no KeyError, TypeError or
    RecursionError), the same way for a checkpoint at resume and a folder a tool reads."""
    from common.training.sealing import MARKER, resolve_checkpoint
    from common.training.faults import UsageError

    text, reason = MALFORMED_MARKERS[kind]
    final = seal(tmp_path / "final", {"model.safetensors": "x", "config.yaml": "a: 1\n"})
    (final / MARKER).write_bytes(text if isinstance(text, bytes) else text.encode())
    assert verify_checkpoint(final).startswith(f"malformed COMPLETE marker ({reason}")
    with pytest.raises(UsageError) as e:
        resolve_checkpoint(tmp_path)
    message = str(e.value)
    assert message.startswith(f"--checkpoint {final}: damaged (malformed COMPLETE marker ({reason}")
    assert "\n" not in message


def test_a_sealed_folder_holds_only_regular_files_and_folders(tmp_path):
    """A symlinked folder (nothing checks what it holds), a FIFO (reading it blocks for ever), a
    broken symlink: refused in one line before any file is opened. A symlink to a regular file (a
    Hugging Face hub snapshot) is followed and checked like the file."""
    from common.training.sealing import resolve_checkpoint, seal_problem
    from common.training.faults import UsageError

    final = seal(tmp_path / "final", {"model.safetensors": "x", "config.yaml": "a: 1\n", "tokenizer/vocab.json": "{}"})
    blob = tmp_path / "blob"
    blob.write_text("a: 1\n")
    (final / "config.yaml").unlink()
    (final / "config.yaml").symlink_to(blob)
    assert seal_problem(final) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cases = {"linked": lambda p: p.symlink_to(elsewhere, target_is_directory=True),
             "fifo": os.mkfifo, "broken": lambda p: p.symlink_to(tmp_path / "gone")}
    said = {"linked": "linked is a symlink to a folder (nothing checks what it holds)",
            "fifo": "fifo is a FIFO (named pipe), not a regular file", "broken": "broken is a broken symlink"}
    for name, make in cases.items():
        make(final / name)
        with pytest.raises(UsageError) as e:
            resolve_checkpoint(final)
        assert str(e.value).startswith(f"--checkpoint {final}: {said[name]}: a sealed folder holds only regular "
                                       f"files and folders; remove it, or re-run the training command")
        (final / name).unlink()
    (final / "tokenizer" / "vocab.json").unlink()
    os.mkfifo(final / "tokenizer" / "vocab.json")  # a sealed file replaced by a FIFO: never opened
    assert "tokenizer/vocab.json is a FIFO (named pipe)" in seal_problem(final)
