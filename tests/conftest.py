from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The built-in corpus, `tiny` profile (a few seconds to generate), shared by the session."""
    from common.corpus import ensure_builtin_corpus

    return ensure_builtin_corpus(tmp_path_factory.mktemp("cache"), profile="tiny")
