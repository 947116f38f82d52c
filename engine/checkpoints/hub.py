"""Models a user already has in the Hugging Face cache, by their hub name: never a download.

``Qwen/Qwen3-1.7B`` is the snapshot of that repository the hub's client (``hf download``,
``huggingface-cli``, transformers, vLLM) left in the cache; ``Qwen/Qwen3-1.7B-GGUF:Q4_K_M``
is the GGUF file of that repository whose name holds the tag, as llama.cpp's ``-hf
repo:quant`` names one. The cache is where the hub's client puts it: ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``; in it a repository is ``models--<owner>--<name>``, its
snapshots ``snapshots/<commit>``, the one ``refs/main`` names being the current one.

A name that is not in the cache is a :class:`~twostroke.engine.checkpoints.errors.ModelLoadError`
that says how to fetch it; nothing is fetched here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from twostroke.engine.checkpoints.errors import ModelLoadError

__all__ = ["HUB_NAME", "hub_cache_dir", "hub_model"]

#: A hub repository's name, ``owner/name``, and an optional ``:TAG`` choosing a GGUF file
#: (a quantization such as ``Q4_K_M``). Neither part starts with a dot, so a name never
#: walks out of the cache.
HUB_NAME = re.compile(r"(?P<owner>[\w-][\w.-]*)/(?P<name>[\w-][\w.-]*)(?::(?P<tag>[\w.-]+))?")
#: A GGUF file that is not a model's weights (a vision projector) or one shard of several.
_NOT_A_MODEL = re.compile(r"mmproj|-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def hub_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face cache's folder, as the hub's client finds it (see the module)."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    base = environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "huggingface" / "hub"


def hub_model(model: str, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The model folder or GGUF file a hub name stands for in the cache, or ``None`` for a
    string that is no hub name (:data:`HUB_NAME`).

    Without a tag, a snapshot with a ``config.json`` is the model folder, and one with a
    single GGUF model file is that file; with a tag, the one GGUF model file whose name holds
    it (any case).

    Raises:
        ModelLoadError: the repository is not in the cache (the message says how to fetch
            it), its snapshot holds no model, several GGUF files and no tag (or a tag that
            picks none or several: the message lists them), or only a GGUF split in shards.
    """
    match = HUB_NAME.fullmatch(model)
    if match is None:
        return None
    owner, name, tag = match["owner"], match["name"], match["tag"]
    cache = hub_cache_dir(environ)
    repository = cache / f"models--{owner}--{name}"
    snapshot = _snapshot(repository)
    if snapshot is None:
        raise ModelLoadError(
            model,
            f"not a file or folder, nor a model in the Hugging Face cache ({cache}); twostroke "
            f"never downloads: fetch it with `hf download {owner}/{name}` (or give a path)",
        )
    gguf = sorted(path for path in snapshot.rglob("*.gguf") if not _NOT_A_MODEL.search(path.name))
    if tag is None:
        if (snapshot / "config.json").is_file():
            return snapshot
        if len(gguf) == 1:
            return gguf[0]
        if not gguf:
            raise ModelLoadError(
                model, f"its snapshot {snapshot} holds neither config.json nor a GGUF model file"
            )
        raise ModelLoadError(model, f"several GGUF files: name one as {model}:TAG; {_listed(gguf)}")
    chosen = [path for path in gguf if tag.lower() in path.name.lower()]
    if len(chosen) == 1:
        return chosen[0]
    if not chosen and any(tag.lower() in p.name.lower() for p in snapshot.rglob("*.gguf")):
        raise ModelLoadError(
            model,
            f"the {tag} GGUF file is split in shards or is no model's weights, which twostroke "
            "does not read; merge the shards with llama.cpp's llama-gguf-split --merge",
        )
    which = "no" if not chosen else "several"
    raise ModelLoadError(model, f"{which} GGUF files match {tag!r}; {_listed(gguf)}")


def _snapshot(repository: Path) -> Path | None:
    """The repository's current snapshot: the one ``refs/main`` names, else the only one (or
    the most recently changed); ``None`` where there is none."""
    snapshots = repository / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repository / "refs" / "main"
    if ref.is_file():
        named = snapshots / ref.read_text().strip()
        if named.is_dir():
            return named
    found = [path for path in snapshots.iterdir() if path.is_dir()]
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def _listed(paths: list[Path]) -> str:
    shown = ", ".join(path.name for path in paths[:12])
    return f"the snapshot holds {shown}" + (
        f" and {len(paths) - 12} more" if len(paths) > 12 else ""
    )
