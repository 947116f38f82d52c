"""Collect every code block in README.md and the docs' Markdown pages as a test (Sybil)."""

from __future__ import annotations

import os
import tempfile

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    # A pattern matches a path from the right, one folder per "*/" (no "**" before 3.13):
    # "docs/*.md" alone would miss docs/reference/ and the folders below it.
    patterns=["README.md", "docs/*.md", "docs/*/*.md", "docs/*/*/*.md"],
).pytest()

# Converted model artifacts go to a cache in the home directory by default; the suite keeps
# its own, so that tests never write outside temporary folders.
os.environ.setdefault("TWOSTROKE_CACHE_DIR", tempfile.mkdtemp(prefix="twostroke-test-cache-"))
