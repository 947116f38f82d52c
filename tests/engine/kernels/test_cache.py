"""build.compile_library and the artifact cache: what is loaded, and when it is built again.

A library runs code the moment it is loaded, so these tests plant what a hostile user or a
damaged disk would leave in the cache and check that it never runs, and that the kernel is
built again. They are not marked ``isa``: the rules do not depend on the instruction set.

A library this process has loaded is never written in place here: its mapping would change
under the process (and a truncated one faults). Like every writer of the cache, the tests
put a new file in its place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from twostroke.engine.artifacts.cache import CACHE_DIR_ENV, LAST_USED, NATIVE_FOLDER, ArtifactCache
from twostroke.engine.artifacts.records import RECORD
from twostroke.engine.kernels import build, glue, paged_attention, projection, stack
from twostroke.engine.kernels.build import NativeBuildError, compile_library
from twostroke.engine.kernels.paged_attention import build_kernel, reference_paged_decode
from twostroke.gpu.isa import cpu_personality

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: What the log says when a cached library is refused.
REBUILDING = "twostroke: building the paged decode kernel again: the cached library is refused ("

#: A library with nothing of a kernel's but the function every library has.
STUB = "int twostroke_vector_bits(void) { return 128; }\n"


def environment(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[CACHE_DIR_ENV] = str(cache)
    return env


def shared_library(folder: Path, name: str, text: str) -> bytes:
    """The bytes of a shared library compiled from ``text``."""
    source = folder / f"{name}.c"
    source.write_text(text)
    output = folder / f"{name}.so"
    compiler = build._compiler(os.environ)
    subprocess.run(
        [*compiler, "-shared", "-fPIC", str(source), "-o", str(output)], check=True, timeout=60
    )
    return output.read_bytes()


def hostile(folder: Path, marker: Path) -> bytes:
    """A library whose constructor, run when it is loaded, leaves ``marker``."""
    return shared_library(
        folder,
        "planted",
        f"""#include <stdio.h>
__attribute__((constructor)) static void planted(void) {{
    FILE *file = fopen("{marker}", "w");
    if (file) fclose(file);
}}
{STUB}""",
    )


def plant(entry: Path, content: bytes) -> Path:
    """Put ``content`` in place of a cache entry's library, with a record that matches it
    (whoever can write the folder can write the record too); the new file is named as the
    cache names libraries, by content."""
    record = json.loads((entry / RECORD).read_text())
    for name in record["files"]:
        (entry / name).unlink()
    digest = hashlib.sha256(content).hexdigest()
    planted = entry / f"planted-{digest[:16]}.so"
    planted.write_bytes(content)
    record["files"] = {planted.name: [len(content), digest]}
    (entry / RECORD).write_text(json.dumps(record))
    return planted


def replace(path: Path, content: bytes) -> None:
    """Give ``path`` new content as a new file (the loaded one stays mapped, unchanged)."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(content)
    os.chmod(fresh, stat.S_IMODE(path.stat().st_mode))
    os.replace(fresh, path)


def kernel(cache: Path, group: int = 1) -> paged_attention.PagedDecodeKernel:
    return build_kernel(
        block_size=2, head_dim=4, group=group, dtype=torch.float32, environ=environment(cache)
    )


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding :func:`kernel`'s library, compiled once for the module."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    kernel(cache)
    return cache


def copy_of(built_cache: Path, tmp_path: Path) -> Path:
    """A cache of the test's own holding :func:`kernel`'s library, as its first build left
    it: the tests that damage or replace the library start from a copy instead of compiling
    it (about 2 s of CPU each, 2 AVX2 cores); modes, record and last use are copied too."""
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    return cache


def works(built: paged_attention.PagedDecodeKernel) -> None:
    """The kernel computes what torch does."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, built.group, 4, generator=generator)
    keys = torch.randn(5, 1, 4, 2, generator=generator)
    values = torch.randn(5, 1, 2, 4, generator=generator)
    tables = torch.tensor([[0, 3], [4, 1]], dtype=torch.int32)
    lengths = torch.tensor([3, 4], dtype=torch.int32)
    expected = reference_paged_decode(query, keys, values, tables, lengths, 0.5)
    torch.testing.assert_close(built(query, keys, values, tables, lengths, 0.5), expected)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# --- what is loaded -----------------------------------------------------------------------------


@pytest.mark.parametrize("opened", ["cache", "entry"])
def test_a_library_planted_where_others_may_write_never_runs(
    tmp_path: Path, built_cache: Path, opened: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user who can write the cache replaces a library and its record: loading it
    would run their constructor in the engine. A cache folder others may write is not used
    (a private build instead); an entry folder they may write is removed and built anew."""
    cache = copy_of(built_cache, tmp_path)
    entry = kernel(cache).path.parent
    marker = tmp_path / "constructor-ran"
    planted = plant(entry, hostile(tmp_path, marker))
    (cache if opened == "cache" else entry).chmod(0o777)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        again = kernel(cache)
    assert not marker.exists(), "the planted library was loaded"
    works(again)
    if opened == "cache":
        assert "twostroke: not using the cache for compiled kernels:" in caplog.text
        assert "is writable by its group or by others (mode 0777)" in caplog.text
        assert cache not in again.path.parents
        assert planted.exists()  # not ours to clean: `twostroke cache clear` is
    else:
        assert REBUILDING in caplog.text
        assert "is writable by its group or by others (mode 0777))" in caplog.text
        assert not planted.exists()
        assert again.path.parent == entry
        assert mode(entry) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_library_of_another_user_never_runs(
    tmp_path: Path, built_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = copy_of(built_cache, tmp_path)
    entry = kernel(cache).path.parent
    marker = tmp_path / "constructor-ran"
    planted = plant(entry, hostile(tmp_path, marker))
    os.chown(planted, 12345, -1)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        again = kernel(cache)
    assert not marker.exists(), "the planted library was loaded"
    assert REBUILDING in caplog.text
    assert "is owned by uid 12345, not by this user (uid 0))" in caplog.text
    assert again.path.parent == entry
    works(again)


def test_a_truncated_library_is_built_again_not_loaded(
    tmp_path: Path, built_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading a truncated library kills the process (SIGBUS in the dynamic loader), so its
    size and SHA-256 are checked against its record first."""
    cache = copy_of(built_cache, tmp_path)
    first = kernel(cache)
    content = first.path.read_bytes()
    replace(first.path, content[:4096])
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        again = kernel(cache)
    assert REBUILDING in caplog.text
    assert f"holds 4096 bytes, its record says {len(content)})" in caplog.text
    assert again.path.read_bytes() == content
    works(again)
    caplog.clear()
    flipped = bytearray(content)
    flipped[len(content) // 2] ^= 0x10
    replace(again.path, bytes(flipped))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        works(kernel(cache))
    assert re.search(r"its sha256 is [0-9a-f]{64}, its record says [0-9a-f]{64}", caplog.text)


def test_a_library_without_its_symbols_is_built_again(
    tmp_path: Path, built_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A library that passes every check of the cache but lacks a function its module binds
    (AttributeError from ctypes) is refused and rebuilt: the next start is not stuck."""
    cache = copy_of(built_cache, tmp_path)
    entry = kernel(cache).path.parent
    plant(entry, shared_library(tmp_path, "stub", STUB))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        again = kernel(cache)
    assert REBUILDING in caplog.text
    assert "lacks twostroke_paged_decode, twostroke_paged_prefill)" in caplog.text
    works(again)


BINDINGS: dict[str, tuple[Any, str, Callable[[], object], Callable[[], object], str]] = {
    # module, its source's name, its build, its fallback (None where the build fails), symbols
    "attention": (
        paged_attention,
        "SOURCE",
        lambda: build_kernel(block_size=2, head_dim=4, group=1, dtype=torch.float32),
        lambda: paged_attention.paged_decode_kernel(
            block_size=2, head_dim=4, num_heads=1, num_kv_heads=1, dtype=torch.float32
        ),
        "twostroke_paged_decode, twostroke_paged_prefill",
    ),
    "glue": (
        glue,
        "GLUE_SOURCE",
        lambda: glue.build_glue(hidden=8, head_dim=4, dtype=torch.float32),
        lambda: glue.decoder_glue(hidden=8, head_dim=4, dtype=torch.float32),
        "twostroke_add_rms_norm, twostroke_rotate_write, twostroke_silu_mul, twostroke_argmax, "
        "twostroke_head_rms_norm",
    ),
    "projection": (
        projection,
        "PROJECTION_SOURCE",
        projection.build_projection,
        projection.projection_kernel,
        "twostroke_projection_supported, twostroke_projection_panel, twostroke_projection_tiles",
    ),
    "stack": (
        stack,
        "SOURCE",
        stack.load_stack,
        stack.stack_library,
        "twostroke_decoder_stack",
    ),
}


def forget_built_kernels() -> None:
    paged_attention._kernel.cache_clear()
    glue._glue.cache_clear()
    projection._kernel.cache_clear()
    stack._library.cache_clear()


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    forget_built_kernels()
    yield
    forget_built_kernels()


@pytest.mark.usefixtures("fresh_kernels")
@pytest.mark.parametrize("name", list(BINDINGS))
def test_every_kernel_module_turns_a_missing_symbol_into_a_build_error(
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its fallback (torch's operators, logged once) runs instead of an AttributeError."""
    module, source, make, fallback, symbols = BINDINGS[name]
    stub = tmp_path / "stub_kernel.c"
    stub.write_text(STUB)
    monkeypatch.setattr(module, source, stub)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    with pytest.raises(
        NativeBuildError, match=f"the library just built is refused: .* lacks {symbols}$"
    ):
        make()
    with caplog.at_level(logging.WARNING):
        assert fallback() is None
    assert f"lacks {symbols}" in caplog.text


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (paged_attention, paged_attention.SOURCE),
        (glue, glue.GLUE_SOURCE),
        (projection, projection.PROJECTION_SOURCE),
        (stack, stack.SOURCE),
    ],
)
def test_every_kernel_module_names_each_function_of_its_source(module: Any, source: Path) -> None:
    """What compile_library checks is what the module binds: every exported function."""
    defined = re.findall(r"^(?:int|void)\s+(twostroke_\w+)\s*\(", source.read_text(), re.MULTILINE)
    bound = [*module.SYMBOLS, *getattr(module, "SUPPORTED_SYMBOLS", ())]
    assert sorted(bound) == sorted(defined)


@pytest.mark.usefixtures("fresh_kernels")
def test_a_projection_build_that_says_it_runs_but_lacks_its_function_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stub = tmp_path / "stub_projection.c"
    stub.write_text(
        STUB
        + "int twostroke_projection_supported(void) { return 1; }\n"
        + "int twostroke_projection_panel(void) { return 48; }\n"
        + "int twostroke_projection_tiles(void) { return 0; }\n"
    )
    monkeypatch.setattr(projection, "PROJECTION_SOURCE", stub)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    with pytest.raises(
        NativeBuildError, match=r"stub_projection-[0-9a-f]{16}\.so lacks twostroke_projection$"
    ):
        projection.build_projection()
    with caplog.at_level(logging.WARNING):
        assert projection.projection_kernel() is None
    assert "lacks twostroke_projection" in caplog.text


# --- how it is built and stored -----------------------------------------------------------------


def test_the_library_is_private_whatever_the_umask(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    previous = os.umask(0)
    try:
        built = kernel(cache)
    finally:
        os.umask(previous)
    for folder in (cache, cache / NATIVE_FOLDER, built.path.parent):
        assert mode(folder) == 0o700, folder
    assert mode(built.path) == mode(built.path.parent / RECORD) == 0o600


def test_the_record_says_what_made_the_library(tmp_path: Path) -> None:
    built = kernel(tmp_path / "cache", group=2)
    record = ArtifactCache(tmp_path / "cache").open(built.path.parent)
    assert record is not None
    made = record.provenance
    assert (made.what, made.source, made.torch, made.dtype) == (
        "library",
        "paged_decode.c",
        torch.__version__,
        "float32",
    )
    assert made.isa == cpu_personality().describe()
    assert made.detail == "-DBLOCK_SIZE=2 -DHEAD_DIM=4 -DGROUP=2"
    assert record.checksum == "sha256"
    [(name, file)] = record.files.items()
    assert name == built.path.name == f"paged_decode-{file.digest[:16]}.so"
    assert (built.path.parent / LAST_USED).is_file()


def test_a_cache_it_cannot_write_builds_a_private_library(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING):
        built = kernel(blocker)
    assert "cannot write" in caplog.text
    assert blocker not in built.path.parents
    works(built)


def test_builds_of_one_library_at_once_use_their_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's whole build runs while this one compiles (the lock between this
    process's threads does not reach it): before, both wrote ``.<name>.so.o`` in the cache,
    and the first to finish deleted the other's object file."""
    source = tmp_path / "kernel.c"
    source.write_text(STUB + "int twostroke_seven(void) { return 7; }\n")
    env = environment(tmp_path / "cache")
    run = build._run
    outputs: list[str] = []
    others: list[Path] = []

    def interleaved(command: list[str]) -> None:
        outputs.append(command[command.index("-o") + 1])
        run(command)
        if len(outputs) == 1:  # this process compiled; the other builds it all now
            others.append(compile_library(source, [], "seven", env, symbols=["twostroke_seven"])[1])

    monkeypatch.setattr(build, "_build_lock", contextlib.nullcontext())
    monkeypatch.setattr(build, "_run", interleaved)
    library, path = compile_library(source, [], "seven", env, symbols=["twostroke_seven"])
    assert library.twostroke_seven() == 7
    assert path == others[0]  # the entry the other process put in place first
    assert len(set(outputs)) == 4  # two object files, two libraries: none shared
    assert not any(str(tmp_path / "cache") in output for output in outputs)
    assert sorted(os.listdir(path.parent)) == sorted([LAST_USED, RECORD, path.name])


@pytest.mark.slow
def test_processes_building_one_library_at_once_all_succeed(tmp_path: Path) -> None:
    """Three processes build the same library into one empty cache, started together."""
    source = tmp_path / "kernel.c"
    source.write_text(STUB + "int twostroke_seven(void) { return 7; }\n")
    program = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from twostroke.engine.kernels.build import compile_library\n"
        "sys.stdin.read(1)\n"  # wait for the others: all compile at once
        f"library, path = compile_library(Path({str(source)!r}), [], 'seven', os.environ,"
        " symbols=['twostroke_seven'])\n"
        "print(library.twostroke_seven(), path)\n"
    )
    env = environment(tmp_path / "cache")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go")
            child.stdin.flush()
        results = [child.communicate(timeout=100) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()  # reaped, its pipes closed
    assert [child.returncode for child in children] == [0, 0, 0], [err for _, err in results]
    assert {out.split()[0] for out, _ in results} == {"7"}
    [path] = {Path(out.split()[1]) for out, _ in results}  # one library, whoever made it
    assert ArtifactCache(tmp_path / "cache").open(path.parent) is not None
    assert os.listdir(tmp_path / "cache" / NATIVE_FOLDER) == [path.parent.name]  # no leftovers
