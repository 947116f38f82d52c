"""C kernels compiled on the machine that runs them, when first needed.

torch has no operator for some of what the CPU's decoder does each step (attention over a
paged cache in place), runs other parts as many small operators (the glue between the
matrix products), and multiplies a decode step's few rows by bfloat16 weights well below the
machine's speed (oneDNN). twostroke writes those few kernels in C, next to this module
(``paged_decode.c``, :mod:`~twostroke.engine.models.native_attention`; ``decoder_glue.c``,
:mod:`~twostroke.engine.models.native_glue`; ``projection_bf16.c``,
:mod:`~twostroke.engine.models.native_projection`), and one that calls the others layer after
layer (``decoder_stack.c``, :mod:`~twostroke.engine.models.native_stack`);
:func:`compile_library` builds them here.

**Built where it runs.** The machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``), the instruction set of the CPU's personality (``-march=native``, or the rung
``TWOSTROKE_CPU_ISA`` caps it at: :mod:`twostroke.gpu.isa`), and the model's shape as
constants, into a shared library in a fraction of a second. Each library says which
instruction set it was built for (:func:`vector_bits`). The library is kept in the artifact cache
(``$TWOSTROKE_CACHE_DIR/native``, see :mod:`~twostroke.engine.models.artifacts`), named by a
hash of the source, the flags, the compiler's version and the CPU's model and flags, so a
later start loads it in milliseconds and a changed machine or compiler builds its own. It
links OpenMP by the soname torch's own libgomp has, so it runs on torch's thread team.

**Tested, not assumed.** Each kernel's module checks a fresh library against torch before
it is used. Where there is no compiler, the build fails, or the check disagrees, one warning
is logged and the model keeps torch's operators. ``TWOSTROKE_NATIVE=0`` turns every compiled
kernel off without a word (for comparisons, or a machine where compiling is not wanted).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from twostroke.engine.models.artifacts import ArtifactCache
from twostroke.gpu.isa import cpu_personality

__all__ = [
    "ELEMENTS",
    "HEADER",
    "NATIVE_ENV",
    "KernelTime",
    "NativeBuildError",
    "address",
    "call",
    "compile_flags",
    "compile_library",
    "native_wanted",
    "relative_difference",
    "timed",
    "vector_bits",
]

#: The element type's header, which every kernel's source includes.
HEADER = Path(__file__).with_name("native_element.h")

#: Environment variable that keeps models and runners off the compiled kernels when set to
#: ``0`` (see :func:`native_wanted`).
NATIVE_ENV = "TWOSTROKE_NATIVE"

#: Element types the kernels are built for, and the define that selects each.
ELEMENTS: Mapping[torch.dtype, str | None] = {torch.float32: None, torch.bfloat16: "ELEMENT_BF16"}

#: Compile flags, besides the instruction set's (:func:`compile_flags`). The math flags let
#: the compiler vectorize the softmax's max and sum reductions and contract products into
#: FMAs; they are passed when compiling only, never when linking, where GCC would add
#: ``crtfastmath.o`` and flush denormals for the whole process (torch included).
_CFLAGS = (
    "-O3",
    "-std=c11",
    "-fPIC",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-ffinite-math-only",
    "-ffp-contract=fast",
)
_LDFLAGS = ("-shared", "-fopenmp")

#: Seconds a compile or link may take before the build counts as failed.
_BUILD_TIMEOUT = 120.0


_log = logging.getLogger(__name__)
_build_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """A kernel could not be compiled, loaded, or did not pass its check."""


@attrs.define
class KernelTime:
    """Wall time spent inside compiled kernels, and their calls, while :func:`timed` is
    active."""

    seconds: float = 0.0
    calls: int = 0


#: The active timer, if any (:func:`timed`).
_timer: KernelTime | None = None


@contextlib.contextmanager
def timed() -> Iterator[KernelTime]:
    """Add up the time every compiled kernel call takes in this block, on any thread.

    ``ctypes`` releases the GIL for a foreign call, so this is the time the kernels leave
    Python free to run (``twostroke profile-step`` adds it to the time inside torch's ops).
    Outside the block, :func:`call` costs one global read.
    """
    global _timer
    timer, previous = KernelTime(), _timer
    _timer = timer
    try:
        yield timer
    finally:
        _timer = previous


def call(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``: how the kernels' modules call into their libraries, timed when a
    :func:`timed` block is active."""
    timer = _timer
    if timer is None:
        return function(*args)
    start = time.perf_counter()
    try:
        return function(*args)
    finally:
        timer.seconds += time.perf_counter() - start
        timer.calls += 1


def address(function: Callable[..., Any]) -> int:
    """Where a library's ``function`` is in memory, for a kernel that calls it by pointer."""
    # (A library's functions are ctypes function pointers, typed as callables here.)
    found = ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[arg-type]
    if found is None:  # a loaded function is never at 0
        raise ValueError(f"{function!r} has no address")
    return found


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference of ``got`` from ``expected``, relative to the largest
    magnitude expected (how the kernels' start-up checks compare with torch)."""
    scale = float(expected.float().abs().max()) or 1.0
    return float((got.float() - expected.float()).abs().max()) / scale


def compile_flags(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every flag a kernel compiles with: the common ones, then the personality's
    instruction set (:meth:`twostroke.gpu.isa.Personality.compile_flags`).

    Args:
        environ: Where ``TWOSTROKE_CPU_ISA`` is read (``os.environ`` if ``None``).

    Raises:
        ValueError: ``TWOSTROKE_CPU_ISA`` names no rung, or one above this CPU's.
    """
    return (*_CFLAGS, *cpu_personality(environ).compile_flags)


def vector_bits(library: ctypes.CDLL) -> int:
    """The widest vectors a compiled library's code uses: 512 (AVX-512), 256 (AVX) or 128
    (SSE and anything else), as its compile flags made it (``native_element.h``)."""
    function = library.twostroke_vector_bits
    function.restype = ctypes.c_int
    return int(function())


def native_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether to use the compiled kernels where they run: unless ``TWOSTROKE_NATIVE=0``."""
    env = os.environ if environ is None else environ
    return env.get(NATIVE_ENV, "") != "0"


def compile_library(
    source: Path, defines: Sequence[str], what: str, environ: Mapping[str, str]
) -> tuple[ctypes.CDLL, Path]:
    """Compile ``source`` with ``defines`` (or find it compiled in the cache) and load it.

    The library lands in the artifact cache's ``native`` folder, named by the source's stem
    and a hash of everything that makes it (see the module); with the cache off
    (``TWOSTROKE_NO_CACHE``), in a temporary folder that is gone once it is loaded.

    Args:
        source: A C file next to this module (it may include ``native_element.h``).
        defines: ``-D`` flags, and any other compile flag (after the common ones, so
            they override them).
        what: Names the kernel in the log lines ("the paged decode kernel").
        environ: Where ``$CC`` and the cache folder are read.

    Returns:
        The loaded library and its path.

    Raises:
        NativeBuildError: no compiler, or a failed compile or load; the message says which.
        ValueError: ``TWOSTROKE_CPU_ISA`` names no rung, or one above this CPU's.
    """
    flags = compile_flags(environ)
    compiler = _compiler(environ)
    cache = ArtifactCache.from_environment(environ)
    with _build_lock:
        if cache is None:
            with tempfile.TemporaryDirectory(prefix="twostroke-native-") as folder:
                path = _build(compiler, flags, source, defines, what, Path(folder))
                return _load(path), path  # the mapping outlives the file
        path = _build(compiler, flags, source, defines, what, cache.root / "native")
        return _load(path), path


def _compiler(environ: Mapping[str, str]) -> list[str]:
    """The C compiler command: ``$CC`` (split like a shell word list), else the first found."""
    chosen = environ.get("CC", "").strip()
    if chosen:
        command = shlex.split(chosen)
        if shutil.which(command[0]) is None:
            raise NativeBuildError(f"$CC names {command[0]!r}, which is not an executable")
        return command
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found is not None:
            return [found]
    raise NativeBuildError("no C compiler found (set $CC, or install cc, gcc or clang)")


def _build(
    compiler: Sequence[str],
    flags: Sequence[str],
    source: Path,
    defines: Sequence[str],
    what: str,
    folder: Path,
) -> Path:
    """The library for ``defines`` in ``folder``: built unless an identical build is there.

    Its name hashes everything that makes it, the instruction-set flags included, so each
    personality has libraries of its own.
    """
    identity = b"\0".join(
        [
            source.read_bytes(),
            HEADER.read_bytes(),
            " ".join([*flags, *defines, "|", *_LDFLAGS]).encode(),
            _compiler_identity(tuple(compiler)).encode(),
            _cpu_identity().encode(),
            torch.__version__.encode(),
        ]
    )
    digest = hashlib.sha256(identity).hexdigest()[:16]
    path = folder / f"{source.stem}-{digest}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise NativeBuildError(f"cannot create {folder}: {error}") from error
    started = time.perf_counter()
    _log.info("twostroke: compiling %s%s", what, f" ({' '.join(defines)})" if defines else "")
    partial = folder / f".{path.name}.{uuid.uuid4().hex}"
    objects = partial.with_suffix(".o")
    try:
        _run([*compiler, *flags, *defines, "-c", str(source), "-o", str(objects)])
        _run([*compiler, *_LDFLAGS, str(objects), "-o", str(partial)])
        os.replace(partial, path)  # atomic: a reader never sees half a library
    finally:
        for leftover in (objects, partial):
            leftover.unlink(missing_ok=True)
    _log.info("twostroke: compiled %s in %.1f s", what, time.perf_counter() - started)
    return path


def _run(command: Sequence[str]) -> None:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"{shlex.join(command)}: {error}") from error
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise NativeBuildError(
            f"{shlex.join(command)} exited with {done.returncode}: " + " | ".join(tail)
        )


def _load(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeBuildError(f"cannot load {path}: {error}") from error


@functools.cache
def _compiler_identity(compiler: tuple[str, ...]) -> str:
    """The compiler's resolved path and version line: a new compiler builds anew."""
    resolved = shutil.which(compiler[0]) or compiler[0]
    try:
        version = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired):
        version = []
    return " ".join([os.path.realpath(resolved), *compiler[1:], *version])


@functools.cache
def _cpu_identity() -> str:
    """The CPU's model and instruction set flags (``-march=native`` compiles for them)."""
    lines: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
                    lines.append(line)
                if not line.strip() and lines:
                    break  # the first processor describes them all
    except OSError:
        pass
    return "".join(lines) or f"{platform.machine()} {platform.processor()}"
