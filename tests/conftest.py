import os
import signal
from pathlib import Path

import pytest

# Subprocesses (accelerate launch, scripts) import this checkout's common/, not whichever one an
# editable install points at (a second worktree, a copied repository).
ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

# A suite started as a background job (`bash .ci/run &`, nohup) inherits SIGINT ignored, and so would
# every launcher it starts: a test's Ctrl-C (SIGINT to the launcher's group) would not stop the
# launcher. Launch as a terminal's foreground job does: exec resets a handled signal to its default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The built-in corpus, `tiny` profile (a few seconds to generate), shared by the session."""
    from tools.corpus import ensure_builtin_corpus

    return ensure_builtin_corpus(tmp_path_factory.mktemp("cache"), profile="tiny")


@pytest.fixture(scope="session")
def ssltiny_corpus(tmp_path_factory) -> Path:
    """The built-in corpus, `ssltiny` profile: tiny's held-out splits, a new augmented training split."""
    from tools.corpus import ensure_builtin_corpus

    return ensure_builtin_corpus(tmp_path_factory.mktemp("cache"), profile="ssltiny")


@pytest.fixture(scope="session")
def bad_corpus(tiny_corpus, tmp_path_factory) -> Path:
    """The tiny corpus plus, in `train`, one entry of each kind a data check must catch."""
    import shutil

    import numpy as np
    import soundfile as sf

    root = tmp_path_factory.mktemp("bad") / "librispeech"
    for split in ("train", "validation"):
        shutil.copytree(tiny_corpus / "librispeech" / split, root / split)
    chap = root / "train" / "999" / "9990"
    chap.mkdir(parents=True)
    tone = lambda seconds, sr=16000: (0.1 * np.sin(np.arange(int(seconds * sr)) * 0.05)).astype("float32")  # noqa: E731
    good = tone(2.0)
    (chap / "999-9990-0001.flac").write_bytes(b"this is not audio" * 100)  # unreadable
    sf.write(chap / "999-9990-0002.flac", good, 16000)
    data = (chap / "999-9990-0002.flac").read_bytes()
    (chap / "999-9990-0002.flac").write_bytes(data[: len(data) // 3])  # truncated mid-stream
    sf.write(chap / "999-9990-0003.flac", np.zeros(32000, "float32"), 16000)  # empty: 2 s of silence
    sf.write(chap / "999-9990-0004.flac", tone(0.2), 16000)  # too short
    sf.write(chap / "999-9990-0005.flac", tone(10.0), 16000)  # too long (tests use max 8 s)
    sf.write(chap / "999-9990-0006.flac", tone(2.0, 8000), 8000)  # wrong sample rate
    sf.write(chap / "999-9990-0007.flac", np.stack([good, good], 1), 16000)  # stereo
    for i in (8, 9, 10):
        sf.write(chap / f"999-9990-{i:04d}.flac", good, 16000)
    (chap / "999-9990.trans.txt").write_text(
        "999-9990-0000 MISSING FILE\n"
        "999-9990-0001 UNREADABLE\n"
        "999-9990-0002 TRUNCATED\n"
        "999-9990-0003 EMPTY AUDIO\n"
        "999-9990-0004 TOO SHORT\n"
        "999-9990-0005 TOO LONG\n"
        "999-9990-0006 EIGHT KILOHERTZ\n"
        "999-9990-0007 STEREO\n"
        "999-9990-0008 DUPLICATE\n"
        "999-9990-0008 DUPLICATE\n"
        "THIS LINE HAS NO ID\n"
        "999-9990-0009\n"
        "999-9990-0010 NUMBERS 123\n"
    )
    return root
