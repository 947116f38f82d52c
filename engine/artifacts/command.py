"""``twostroke cache``: what the artifact cache holds, and pruning or clearing it.

* ``twostroke cache`` (or ``cache list``) lists the entries, most recently used first: when
  each was last used, its size, what it holds (weights in which dtype, the tokenizer, a
  compiled library), the torch version and CPU personality that made it, and its source
  (the model file; a library's C source and defines);
* ``twostroke cache prune`` removes the least recently used entries until the cache fits
  its limit (``TWOSTROKE_CACHE_LIMIT``, or ``--max-size``), and with ``--keep N`` all but
  the ``N`` most recently used;
* ``twostroke cache clear`` removes every entry.

``prune`` and ``clear`` remove entries only from a folder the cache made (one holding its
``CACHEDIR.TAG``); given a folder of the user's, or an older twostroke's cache, they remove
nothing and exit with status 1, saying why.

The cache itself is :mod:`~twostroke.engine.artifacts.cache`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from twostroke.engine.artifacts.cache import (
    CACHE_LIMIT_ENV,
    MARKER,
    NO_CACHE_ENV,
    ArtifactCache,
    CacheEntry,
    InvalidCacheLimit,
    UnmarkedCache,
    format_size,
    parse_size,
)
from twostroke.engine.artifacts.records import Record
from twostroke.engine.config import count_argument

__all__ = ["add_cache_arguments", "cache_command", "entry_rows"]

_HEADINGS = ("last used", "size", "what", "torch", "ISA", "source")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``twostroke cache``'s actions and their options."""
    actions = parser.add_subparsers(dest="cache_action", metavar="{list,prune,clear}")
    actions.add_parser("list", help="the entries, most recently used first (the default)")
    prune = actions.add_parser(
        "prune", help="remove the least recently used entries until the cache fits"
    )
    prune.add_argument(
        "--keep",
        type=count_argument("--keep"),
        default=None,
        metavar="N",
        help="also remove all but the N most recently used entries",
    )
    prune.add_argument(
        "--max-size",
        type=_max_size,
        default=None,
        metavar="SIZE",
        help=f"the size to fit (8GiB, 500MB, bytes, or unlimited; default: ${CACHE_LIMIT_ENV}, "
        "else 8GiB)",
    )
    actions.add_parser("clear", help="remove every entry")


def _max_size(text: str) -> int | str:
    try:
        size = parse_size(text, name="--max-size")
    except InvalidCacheLimit as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return "unlimited" if size is None else size


def cache_command(args: argparse.Namespace) -> int:
    """Run ``twostroke cache``; the exit status (2: the environment is wrong; 1: ``prune``
    or ``clear`` asked of a folder the cache did not make, from which nothing was removed)."""
    try:
        cache = ArtifactCache.from_environment()
    except InvalidCacheLimit as error:
        print(f"twostroke cache: error: {error}", file=sys.stderr)
        return 2
    if cache is None:
        print(f"the artifact cache is off ({NO_CACHE_ENV}=1)")
        return 0
    action = args.cache_action or "list"
    try:
        if action == "clear":
            _report_removed(cache.clear(), "cleared")
        elif action == "prune":
            bound: int | None = cache.limit
            if args.max_size is not None:
                bound = None if args.max_size == "unlimited" else int(args.max_size)
            _report_removed(cache.prune(limit=bound, keep_newest=args.keep), "pruned")
        else:
            _list(cache)
    except UnmarkedCache as error:
        print(f"twostroke cache: error: {error}", file=sys.stderr)
        return 1
    return 0


def _report_removed(removed: Sequence[CacheEntry], done: str) -> None:
    for entry in removed:
        print(f"removed {entry.path} ({format_size(entry.size)})")
    total = format_size(sum(entry.size for entry in removed))
    count = f"{len(removed)} {'entry' if len(removed) == 1 else 'entries'}"
    print(f"{done}: {count}, {total}")


def _list(cache: ArtifactCache) -> None:
    entries = cache.entries()
    total = sum(entry.size for entry in entries)
    limit = "no limit" if cache.limit is None else f"limit {format_size(cache.limit)}"
    count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    print(f"{cache.root}: {format_size(total)} in {count} ({limit}, ${CACHE_LIMIT_ENV})")
    marked = cache.marked()
    if entries and not marked:
        print(
            f"note: it holds no {MARKER} of the cache's (a folder of yours, or an older "
            "twostroke's cache): nothing in it is evicted, pruned or cleared; if it holds "
            "only twostroke's cache, delete it and the next load makes it afresh"
        )
    unsafe = cache.unsafe()
    if unsafe is not None:
        remedy = (
            "`twostroke cache clear` empties it and makes it private"
            if marked
            else "make it private (chmod 700) or point $TWOSTROKE_CACHE_DIR at a folder of yours"
        )
        print(f"warning: {unsafe}: nothing in it is loaded ({remedy})")
    if not entries:
        return
    rows = [_HEADINGS, *entry_rows(entries)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_HEADINGS) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]))


def entry_rows(entries: Sequence[CacheEntry]) -> list[tuple[str, str, str, str, str, str]]:
    """One row of ``twostroke cache``'s table per entry: last used, size, what, torch, ISA,
    source."""
    rows = []
    for entry in entries:
        records = [record for _, record in entry.artifacts if record is not None]
        first = records[0].provenance if records else None
        if entry.kind == "library":
            what = "library" if first is None else " ".join(filter(None, ["library", first.dtype]))
            source = (
                entry.path.name
                if first is None
                else " ".join(filter(None, [first.source, first.detail]))
            )
        else:
            what = ", ".join(_describe(name, record) for name, record in entry.artifacts)
            source = entry.source or "?"
        if not records:
            what += " (no record: an older twostroke's)"
        rows.append(
            (
                time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used)),
                format_size(entry.size),
                what or "nothing",
                (first.torch if first else None) or "-",
                (first.isa if first else None) or "-",
                source,
            )
        )
    return rows


def _describe(name: str, record: Record | None) -> str:
    if record is None:
        return name
    made = record.provenance
    return " ".join(filter(None, [made.what, made.dtype]))
