"""The artifact cache: what is converted from a model file once, and read back by later runs.

Loading SmolLM2's GGUF takes seconds that are all conversion: dequantizing every tensor
(about 1 s) and building a fast tokenizer out of the GGUF vocabulary through
``transformers`` (1.1 s, plus 2-3 s to import it). The results depend on the file alone, so
the first load writes them to a cache folder and the next loads read them back: the
weights as safetensors in the model's dtype, read straight into the parameters
(:mod:`~twostroke.engine.models.safetensors_into`), the tokenizer as ``tokenizer.json``,
its configuration and its chat template, read without ``transformers``
(:mod:`~twostroke.engine.text.saved_tokenizer`).

Where: ``$TWOSTROKE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/twostroke``, else
``~/.cache/twostroke``; ``TWOSTROKE_NO_CACHE=1`` turns the cache off. Each source file has
its own folder, named after the file and keyed by its resolved path, size and modification
time, so an edited or replaced file is converted again. A folder records the path of its
source (``source``); each conversion removes the folders it makes stale: those of its own
file at an earlier size or time, those whose file is gone (a deleted virtual environment,
an uninstalled package), and folders of the same file name without a record (written before
records were kept). So the cache holds one folder per model file that still exists (about
0.6 GB for SmolLM2 in float32), not one per install. Deleting the cache folder is always safe.

Every artifact is written to a temporary name in its final folder and renamed into place,
so a reader never sees half a file, and two processes converting the same model at once
both succeed (the last rename wins; the contents are the same). A cache that cannot be
written (read-only home, full disk) is logged and skipped: loading never fails because of it.

This module does no conversion itself and imports neither torch nor transformers; the
loader and the tokenizer decide what to store.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

__all__ = ["CACHE_DIR_ENV", "NO_CACHE_ENV", "SOURCE_RECORD", "ArtifactCache"]

#: Environment variable naming the cache folder.
CACHE_DIR_ENV = "TWOSTROKE_CACHE_DIR"
#: Environment variable that turns the cache off when set to ``1``.
NO_CACHE_ENV = "TWOSTROKE_NO_CACHE"

#: Bumped when the layout or the contents of a cache folder change.
_FORMAT = 1

#: The file in an entry folder that records the resolved path of the entry's source.
SOURCE_RECORD = "source"

_log = logging.getLogger(__name__)


@attrs.frozen
class ArtifactCache:
    """A cache folder holding one subfolder per converted source file.

    Attributes:
        root: The cache folder (created on first write).
    """

    root: Path = attrs.field(converter=Path)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ArtifactCache | None:
        """The cache the environment asks for, or ``None`` when it is turned off.

        Args:
            environ: The environment (``os.environ`` when ``None``).

        Returns:
            The cache at ``$TWOSTROKE_CACHE_DIR``, ``$XDG_CACHE_HOME/twostroke`` or
            ``~/.cache/twostroke``; ``None`` if ``TWOSTROKE_NO_CACHE`` is ``1``.
        """
        env = os.environ if environ is None else environ
        if env.get(NO_CACHE_ENV, "") == "1":
            return None
        explicit = env.get(CACHE_DIR_ENV)
        if explicit:
            return cls(Path(explicit).expanduser())
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(base) / "twostroke")

    def entry(self, source: Path) -> Path:
        """The folder of ``source``'s artifacts (it may not exist yet).

        Args:
            source: The model file the artifacts are converted from; it must exist.

        Returns:
            ``root / "<file name>-<key>"``, the key hashing the resolved path, the size, the
            modification time and the cache format.

        Raises:
            OSError: ``source`` cannot be read.
        """
        resolved = source.resolve()
        stat = resolved.stat()
        identity = f"{_FORMAT}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        return self.root / f"{resolved.name}-{digest}"

    def prepare(self, source: Path) -> Path:
        """The folder to write ``source``'s artifacts into, recording the source in it, and
        with the folders this conversion makes stale removed (see the module).

        Call it when ``source`` was converted (a cache miss), before storing what the
        conversion made; never on reads.

        Args:
            source: The model file the artifacts are converted from; it must exist.

        Returns:
            :meth:`entry` of ``source``.

        Raises:
            OSError: ``source`` cannot be read.
        """
        entry = self.entry(source)
        resolved = str(source.resolve())

        def record(path: Path) -> None:
            path.write_text(resolved + "\n")

        if not (entry / SOURCE_RECORD).is_file():
            self.store(entry / SOURCE_RECORD, record)
        for stale in self._stale(entry, resolved):
            _log.info("twostroke: removing the stale cache folder %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        return entry

    def _stale(self, entry: Path, resolved: str) -> list[Path]:
        """The folders besides ``entry`` that the conversion of ``resolved`` makes stale."""
        try:
            folders = [folder for folder in self.root.iterdir() if folder.is_dir()]
        except OSError:
            return []
        name = f"{Path(resolved).name}-"
        stale = []
        for folder in folders:
            if folder == entry or folder.name.startswith("."):
                continue
            try:
                recorded = (folder / SOURCE_RECORD).read_text().strip()
            except FileNotFoundError:
                if folder.name.startswith(name):  # this file's, from before records
                    stale.append(folder)
                continue
            except OSError:
                continue
            if recorded == resolved or not Path(recorded).exists():
                stale.append(folder)
        return stale

    def store(self, path: Path, write: Callable[[Path], None]) -> bool:
        """Create ``path`` atomically: ``write`` fills a temporary file, then it is renamed.

        Args:
            path: The artifact's final path, inside an :meth:`entry` folder.
            write: Writes the artifact to the path it is given (a file, or a folder it
                creates).

        Returns:
            Whether the artifact is now in place. Failures to write are logged, not raised.
        """
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(temporary)
            try:
                os.replace(temporary, path)
            except OSError:
                if not (temporary.is_dir() and path.is_dir()):
                    raise
                # Another process put the same folder in place first (a folder cannot
                # replace a non-empty one); theirs is as good as ours.
            return True
        except Exception as error:  # an optimization must not fail the load it speeds up
            _log.warning(
                "twostroke: cannot write %s to the cache (%s: %s); continuing",
                path,
                type(error).__name__,
                error,
            )
            return False
        finally:
            if temporary.is_dir():
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    temporary.unlink(missing_ok=True)
