"""tools/real_prompts.py: a fake prompt package in tmp (G.722 files + a transcript file in Debian's
format), and the real French package where it is installed."""

from __future__ import annotations

import gzip
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from common.data.manifest import read_librispeech, read_ljspeech
from tools.real_prompts import SOUNDS_ROOT, DOC_ROOT, build, clean_text, split_of

REPO_ROOT = Path(__file__).resolve().parents[2]

TRANSCRIPT = """\ufeff; Core Asterisk Sounds in French

activated: activé
agent-pass: Composez votre mot de passe suivi du dièse.
ascending-2tone: [ascending tones]
conf-adminmenu: conf-adminmenu: “Pour quitter, appuyez sur 8.”
for: Pour (emphase)
no-audio: cette ligne n'a pas de son
digits/3: trois
digits/8: huit
letters/e: e
"""
TRANSCRIPT_IDS = [line.split(":")[0] for line in TRANSCRIPT.splitlines()[2:] if line]
# digits/3 falls in validation, digits/8 in test: the split is a pure function of the prompt id
PROMPTS = ["activated", "agent-pass", "ascending-2tone", "conf-adminmenu", "for", "digits/3", "digits/8",
           "letters/e", "unlisted"]


def _fake_package(root: Path, link: bool = True) -> tuple[Path, Path]:
    """`link` False: as `dpkg-deb -x` unpacks the packages (no install script: no `fr` link)."""
    from G722 import G722

    sounds, doc = root / "sounds", root / "doc"
    voice = sounds / "fr_CA_f_June"
    for i, prompt in enumerate(PROMPTS):
        t = np.arange(int(16000 * (0.6 + 0.1 * i))) / 16000
        wav = (8000 * np.sin(2 * np.pi * (200 + 50 * i) * t)).astype(np.int16)
        (voice / prompt).parent.mkdir(parents=True, exist_ok=True)
        (voice / f"{prompt}.g722").write_bytes(bytes(G722(16000, 64000).encode(wav)))
    if link:
        (sounds / "fr").symlink_to(voice)  # Debian's alternatives link
    (doc / "asterisk-core-sounds-fr").mkdir(parents=True)
    (doc / "asterisk-core-sounds-fr" / "core-sounds-fr.txt.gz").write_bytes(
        gzip.compress(TRANSCRIPT.encode(), mtime=0))
    return sounds, doc


def _digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fake_package_gives_both_layouts_with_a_fixed_split(tmp_path):
    sounds, doc = _fake_package(tmp_path / "pkg")
    summary = build("fr", tmp_path / "a", sounds, doc)
    kept = ["activated", "agent-pass", "conf-adminmenu", "digits/3", "digits/8", "for", "letters/e"]
    assert summary["left out"] == {"no audio": 1, "no transcript": 1, "no spoken text": 1,
                                   "too short": 0, "too long": 0}
    assert sum(summary["written"].values()) == len(kept)

    # LibriSpeech layout: speaker 1 (fr), chapter = split, utt = position among the sorted prompt ids
    position = {p: i for i, p in enumerate(sorted(TRANSCRIPT_IDS))}
    expected_ids = {split: sorted(f"1-{(1, 2, 3)[('train', 'validation', 'test').index(split)]}-{position[p]:04d}"
                                  for p in kept if split_of(p) == split)
                    for split in ("train", "validation", "test")}
    assert all(expected_ids.values()), "the fake prompts must reach every split"
    texts = {}
    for split, ids in expected_ids.items():
        ds = read_librispeech(tmp_path / "a" / "librispeech", split)
        assert ds["id"] == ids and set(ds["sample_rate"]) == {16000}
        texts.update(zip(ds["id"], ds["text"]))
    by_prompt = {p: texts[i] for i in texts for p in kept if i.endswith(f"-{position[p]:04d}")}
    assert by_prompt["conf-adminmenu"] == "Pour quitter, appuyez sur 8."  # repeated id and quotes gone
    assert by_prompt["for"] == "Pour"  # (emphase) is a note, not speech
    assert by_prompt["activated"] == "activé"

    # LJSpeech layout: same ids, sorted train → validation → test; original text kept beside the clean one
    lj = read_ljspeech(tmp_path / "a" / "ljspeech")
    all_ids = [i for split in ("train", "validation", "test") for i in expected_ids[split]]
    assert lj["id"] == all_ids
    lines = (tmp_path / "a" / "ljspeech" / "metadata.csv").read_text().splitlines()
    assert f"|conf-adminmenu: “Pour quitter, appuyez sur 8.”|Pour quitter, appuyez sur 8." in "\n".join(lines)
    assert sf.info(str(tmp_path / "a" / "ljspeech" / "wavs" / f"{all_ids[0]}.wav")).samplerate == 16000

    # byte-identical on a second build
    build("fr", tmp_path / "b", sounds, doc)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")



def test_split_and_cleaning_are_pure_functions():
    assert [split_of(p) for p in ("activated", "digits/3", "digits/8")] == ["train", "validation", "test"]
    counts = {s: sum(split_of(f"prompt-{i}") == s for i in range(2000)) for s in ("train", "validation", "test")}
    assert 150 < counts["test"] < 250 and 150 < counts["validation"] < 250
    assert clean_text("x", "[beep]") == ""
    assert clean_text("x", "l’heure… <tone> «oui»") == "l'heure... oui"
    assert clean_text("x", "Cafe\u0301") == "Café"  # NFC: one code point


def test_refusals_are_one_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tools.real_prompts", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True)

    missing = run("--lang", "es", "--out", str(tmp_path / "o"), "--doc_root", str(tmp_path), "--sounds_root",
                  str(tmp_path))
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [missing.stderr.strip()]
    assert "apt-get install -y asterisk-core-sounds-es asterisk-core-sounds-es-g722" in missing.stderr
    english = run("--lang", "en", "--out", str(tmp_path / "o"))
    assert english.returncode == 2 and "outside check" in english.stderr
    assert not (tmp_path / "o").exists()
    sounds, doc = _fake_package(tmp_path / "pkg")
    (tmp_path / "a_file").write_text("")
    unwritable = run("--lang", "fr", "--out", str(tmp_path / "a_file" / "o"), "--doc_root", str(doc),
                     "--sounds_root", str(sounds))
    assert unwritable.returncode == 2 and unwritable.stdout == ""
    assert unwritable.stderr.strip().splitlines() == [unwritable.stderr.strip()]
    assert f"--out {tmp_path / 'a_file' / 'o'}: cannot create" in unwritable.stderr


def test_unpacked_packages_need_no_root_and_the_flags_say_so(tmp_path):
    """--sounds_root/--doc_root are in --help (they were hidden), and they take packages unpacked
    with `dpkg-deb -x` (no root, no alternatives link `fr` → `fr_CA_f_June`): the same corpus."""
    shown = subprocess.run([sys.executable, "-m", "tools.real_prompts", "--help"], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    assert shown.returncode == 0 and "--sounds_root" in shown.stdout and "--doc_root" in shown.stdout
    assert "dpkg-deb -x" in shown.stdout
    build("fr", tmp_path / "installed", *_fake_package(tmp_path / "pkg"))
    build("fr", tmp_path / "unpacked", *_fake_package(tmp_path / "deb", link=False))
    assert _digests(tmp_path / "unpacked") == _digests(tmp_path / "installed")


# The split sizes documented in tools/README.md (Debian 12, asterisk-core-sounds 1.6.1-1).
DOCUMENTED = {"fr": (388, 53, 53), "es": (364, 48, 52), "it": (425, 53, 55), "ru": (399, 55, 56)}


@pytest.mark.skipif(not (Path(DOC_ROOT) / "asterisk-core-sounds-fr").is_dir()
                    or not list((Path(SOUNDS_ROOT) / "fr").glob("*.g722")),
                    reason="needs: apt-get install -y asterisk-core-sounds-fr asterisk-core-sounds-fr-g722")
def test_the_installed_french_package(tmp_path):
    summary = build("fr", tmp_path / "fr")
    assert tuple(summary["written"].values()) == DOCUMENTED["fr"]
    for split in ("train", "validation", "test"):
        ds = read_librispeech(tmp_path / "fr" / "librispeech", split)
        assert min(ds["duration"]) >= 0.5 and max(ds["duration"]) <= 30.0
    assert len(read_ljspeech(tmp_path / "fr" / "ljspeech")) == sum(DOCUMENTED["fr"])
