"""MkDocs hook: lay the sources out as the wheel installs them, for the API reference.

The wheel installs the folders ``states/``, ``gpu/`` and ``engine/`` as ``twostroke.states``,
``twostroke.gpu`` and ``twostroke.engine`` (setuptools ``package-dir``; ``twostroke`` is a
namespace package without ``__init__.py``). The editable install reaches them through an
import hook that griffe, which reads the sources for mkdocstrings, does not follow: it would
find no ``twostroke`` at all. Like ``make typecheck`` does for mypy, this hook makes a tree of
links, ``build/api-src/twostroke/{states,gpu,engine}``, taken from ``package-dir`` in
pyproject.toml, and mkdocs.yml points the Python handler's ``paths`` at it. It runs on every
``mkdocs build`` and ``mkdocs serve``, so a fresh clone needs no other step.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

SOURCE_TREE = Path("build") / "api-src"


def link_source_tree(root: Path) -> Path:
    """Create (or refresh) the link tree under ``root / SOURCE_TREE``.

    Args:
        root: The repository root, where pyproject.toml lies.

    Returns:
        The folder to put on the documentation's search path.

    Raises:
        ValueError: If a ``package-dir`` entry is not ``twostroke.<name>`` or its folder is
            missing.
    """
    with (root / "pyproject.toml").open("rb") as file:
        package_dir: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    tree = root / SOURCE_TREE
    namespace = tree / "twostroke"
    namespace.mkdir(parents=True, exist_ok=True)
    for package, folder in package_dir.items():
        top, _, name = package.partition(".")
        if top != "twostroke" or not name or "." in name:
            raise ValueError(f"package-dir keys must be twostroke.<name>, got {package!r}")
        source = root / folder
        if not source.is_dir():
            raise ValueError(f"package-dir maps {package} to a missing folder, got {folder!r}")
        link = namespace / name
        target = os.path.relpath(source, namespace)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return tree


@event_priority(100)  # mkdocstrings creates its handlers, and reads `paths`, in its on_config.
def on_config(config: Any) -> Any:
    """Build the link tree before mkdocstrings' Python handler reads its ``paths``."""
    link_source_tree(Path(config.config_file_path).parent)
    return config
