"""Collect every code block in README.md and docs/*.md as a test (Sybil)."""

from __future__ import annotations

import os
import tempfile

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
).pytest()

# Converted model artifacts go to a cache in the home directory by default; the suite keeps
# its own, so that tests never write outside temporary folders.
os.environ.setdefault("TWOSTROKE_CACHE_DIR", tempfile.mkdtemp(prefix="twostroke-test-cache-"))
