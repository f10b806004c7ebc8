import os
import signal
import time
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """PYTEST_TIMELINE=<file>: one JSON line per test (worker, start, end; epoch seconds), to see
    which tests overlap the suite's idle seconds (README, "Tests": profiling the suite)."""
    start = time.time()
    yield
    if os.environ.get("PYTEST_TIMELINE"):
        import json

        with open(os.environ["PYTEST_TIMELINE"], "a") as f:
            f.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "gw0"),
                                "start": round(start, 2), "end": round(time.time(), 2)}) + "\n")


def pytest_collection_modifyitems(config, items):
    """End-to-end tests (`slow`) first, each group in its collected order: with pytest-xdist the
    long tests start early and the short ones fill the workers' gaps, instead of one long test
    running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _one_process_launcher(request):
    """`@pytest.mark.accelerate_launch`: this test's runs go through `accelerate launch`, in fresh
    interpreters (the others are forked from the harness's fork server: the same training, without
    the launcher's and the imports' start-up; see tests/harness/harness.py)."""
    from tests.harness import harness

    harness.REAL_LAUNCH[0] = request.node.get_closest_marker("accelerate_launch") is not None
    yield
    harness.REAL_LAUNCH[0] = False


def suite_dir(tmp_path_factory) -> Path:
    """A folder of this test run shared by all its pytest-xdist workers (each has its own basetemp
    below it); without xdist, the run's basetemp itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _cpu_tokens(tmp_path_factory):
    """Under pytest-xdist, the workers' runs share the cores through CPU tokens (tests/harness/harness.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.harness.harness import TOKENS_DIR

        folder = suite_dir(tmp_path_factory) / "cpu_tokens"
        folder.mkdir(exist_ok=True)
        os.environ[TOKENS_DIR] = str(folder)
    yield


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_worker():
    """Under pytest-xdist, a worker's own torch work (the in-process tests: data, models, losses, exports)
    runs on one thread, and so do the fresh interpreters it starts itself (OMP_NUM_THREADS=1, as the
    harness's runs already have it: harness.base_env). With torch's default, a thread per core, 4 workers
    on 2 cores spin in OpenMP's barriers (measured on a loaded 2-core machine: the fast tier of test_asr,
    test_best_rq and test_vocoder in 2 workers took 376 s of wall time and 48 s of CPU with 2 threads a
    worker, 45 s and 16 s with 1). One count everywhere also keeps a tensor computed here bit-equal to one
    a fresh interpreter computes (CPU float sums are split by thread). A recipe reads OMP_NUM_THREADS=1 as
    unset (common/training/distributed.py, plan_threads); a test that wants more says so."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session", autouse=True)
def _own_corpus_cache(tmp_path_factory):
    """The built-in corpus and the built-in bases (`--init_from builtin`) a test makes without naming a
    cache go to this test run's folder, never to the user's ~/.cache/speech_recipes."""
    os.environ["SPEECH_RECIPES_CACHE"] = str(suite_dir(tmp_path_factory) / "default_cache")
    yield


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The built-in corpus, `tiny` profile (a few seconds to generate), built once per test run: the
    first worker to ask builds it under the corpus cache's file lock, the others wait for it."""
    from tools.corpus import ensure_builtin_corpus

    return ensure_builtin_corpus(suite_dir(tmp_path_factory) / "cache", profile="tiny")


@pytest.fixture(scope="session")
def ssltiny_corpus(tmp_path_factory) -> Path:
    """The built-in corpus, `ssltiny` profile: tiny's held-out splits, a new augmented training split."""
    from tools.corpus import ensure_builtin_corpus

    return ensure_builtin_corpus(suite_dir(tmp_path_factory) / "cache", profile="ssltiny")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(recipe, nproc, make_args)` -> the output folder of a run never interrupted, trained
    once per test run and shared by every test, in every pytest-xdist worker, that asks for the same
    command (`make_args(output_dir)` -> the recipe's arguments). Tests compare their interrupted runs
    against it and only read it: a test that writes into a run makes its own."""
    import fcntl
    import hashlib
    import json
    import shutil

    from tests.harness.harness import run

    root = suite_dir(tmp_path_factory) / "references"
    root.mkdir(exist_ok=True)

    def get(recipe: str, nproc: int, make_args, env: dict | None = None) -> Path:
        key = hashlib.sha256(json.dumps([recipe, nproc, make_args(Path("OUT")), env]).encode()).hexdigest()[:16]
        folder = root / f"{recipe}{nproc}-{key}"
        with open(f"{folder}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker trains it, the others wait (released on close)
            if not (folder / "DONE").exists():
                shutil.rmtree(folder, ignore_errors=True)  # a run a failed test left half-done
                folder.mkdir()
                run(recipe, nproc, make_args(folder / "run"), env=env, launcher=False)
                (folder / "DONE").touch()
        return folder / "run"

    return get


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
