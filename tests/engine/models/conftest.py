"""Model test fixtures: the artifact cache lives in a temporary folder, never in the home."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from twostroke.engine.models.artifacts import CACHE_DIR_ENV, NO_CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def artifact_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``$TWOSTROKE_CACHE_DIR`` at a session folder for every test here."""
    folder = tmp_path_factory.mktemp("artifact-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(folder))
        patch.delenv(NO_CACHE_ENV, raising=False)
        yield folder
