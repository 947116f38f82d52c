"""C kernels compiled on the machine that runs them, when first needed.

torch has no operator for some of what the CPU's decoder does each step (attention over a
paged cache in place), runs other parts as many small operators (the glue between the
matrix products), and multiplies a decode step's few rows by bfloat16 weights well below the
machine's speed (oneDNN). twostroke writes those few kernels in C, next to this module
(``paged_decode.c``, :mod:`~twostroke.engine.kernels.paged_attention`; ``decoder_glue.c``,
:mod:`~twostroke.engine.kernels.glue`; ``projection_bf16.c``,
:mod:`~twostroke.engine.kernels.projection`), and one that calls the others layer after
layer (``decoder_stack.c``, :mod:`~twostroke.engine.kernels.stack`);
:func:`compile_library` builds them here.

**Built where it runs.** The machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``), the instruction set of the CPU's personality (``-march=native``, or the rung
``TWOSTROKE_CPU_ISA`` caps it at: :mod:`twostroke.gpu.isa`), and the model's shape as
constants, into a shared library in a fraction of a second. Each library says which
instruction set it was built for (:func:`vector_bits`). The library is kept in the artifact
cache (``$TWOSTROKE_CACHE_DIR/native``, see :mod:`~twostroke.engine.artifacts.cache`), in
a folder named by a hash of the source, the flags, the compiler's version and the CPU's
model and flags, so a later start loads it in milliseconds and a changed machine or
compiler builds its own. It links OpenMP by the soname torch's own libgomp has, so it runs
on torch's thread team.

**Declared once.** Every function a library exports, and the structures the stack takes,
are declared in ``kernels.h``, which each source includes (so a definition that differs does
not compile) and :mod:`.header` reads (so each binding's argument types are the header's:
:func:`bind`).

**Loaded only when it is ours.** A library runs code in the engine the moment it is loaded
(its constructors), so a cached one is loaded only after the cache has checked it
(:meth:`~twostroke.engine.artifacts.cache.ArtifactCache.open`): every folder from the cache
down to it belongs to this user and is writable by no one else, and its SHA-256 is the one
recorded when it was built. A library that fails the check, does not load, or lacks a
symbol its module binds is built again; a cache folder that others may write is not used at
all (the library is built in a private temporary folder, and a warning says so). Each build
compiles in a folder of its own and the result is renamed into place, so processes that
build one kernel at once do not collide.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from twostroke.engine.artifacts.cache import NATIVE_FOLDER, ArtifactCache
from twostroke.engine.artifacts.records import (
    DamagedArtifact,
    Provenance,
    Record,
    UnsafeCachePath,
    digest_file,
)
from twostroke.engine.kernels.header import KERNELS_HEADER, HeaderError, declarations
from twostroke.gpu.host import cpuinfo_text
from twostroke.gpu.isa import cpu_personality

__all__ = [
    "CACHE_ELEMENTS",
    "ELEMENTS",
    "HEADER",
    "NATIVE_ENV",
    "KernelTime",
    "NativeBuildError",
    "address",
    "bind",
    "call",
    "compile_flags",
    "compile_library",
    "element_defines",
    "lookup",
    "native_wanted",
    "relative_difference",
    "timed",
    "vector_bits",
]

#: The element type's header, which every kernel's source includes (through kernels.h).
HEADER = Path(__file__).with_name("native_element.h")

#: Environment variable that keeps models and runners off the compiled kernels when set to
#: ``0`` (see :func:`native_wanted`).
NATIVE_ENV = "TWOSTROKE_NATIVE"

#: Element types the kernels are built for, and the define that selects each.
ELEMENTS: Mapping[torch.dtype, str | None] = {torch.float32: None, torch.bfloat16: "ELEMENT_BF16"}

#: The KV cache's element types the kernels that read or write it are built for, and the
#: define that selects each where it is not the activations' (``native_element.h``).
CACHE_ELEMENTS: Mapping[torch.dtype, str] = {
    torch.float32: "CACHE_F32",
    torch.float16: "CACHE_F16",
    torch.bfloat16: "CACHE_BF16",
}


def element_defines(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> list[str]:
    """The ``-D`` flags of a kernel whose tensors are ``dtype`` and whose KV cache is
    ``cache_dtype`` (``None``: ``dtype``).

    Raises:
        ValueError: either is not a type the kernels are built for (:data:`ELEMENTS`,
            :data:`CACHE_ELEMENTS`).
    """
    if dtype not in ELEMENTS:
        raise ValueError(f"a native kernel takes float32 or bfloat16, got {dtype}")
    defines = [] if ELEMENTS[dtype] is None else [f"-D{ELEMENTS[dtype]}"]
    if cache_dtype is None or cache_dtype == dtype:
        return defines
    if cache_dtype not in CACHE_ELEMENTS:
        raise ValueError(
            f"a native kernel holds the KV cache in float32, float16 or bfloat16, got {cache_dtype}"
        )
    return [*defines, f"-D{CACHE_ELEMENTS[cache_dtype]}"]


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
    """A kernel could not be compiled, loaded, lacks a symbol, or did not pass its check."""


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
    function = bind(library, Path(library._name), "twostroke_vector_bits")
    return int(function())


def native_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether to use the compiled kernels where they run: unless ``TWOSTROKE_NATIVE=0``."""
    env = os.environ if environ is None else environ
    return env.get(NATIVE_ENV, "") != "0"


def compile_library(
    source: Path,
    defines: Sequence[str],
    what: str,
    environ: Mapping[str, str],
    *,
    symbols: Sequence[str] = (),
    dtype: torch.dtype | None = None,
) -> tuple[ctypes.CDLL, Path]:
    """Compile ``source`` with ``defines`` (or find it compiled in the cache) and load it.

    The library lands in an entry of the artifact cache's ``native`` folder, named by the
    source's stem and a hash of everything that makes it (see the module), with a record of
    what made it and its SHA-256; with the cache off (``TWOSTROKE_NO_CACHE``) or not this
    user's alone, in a temporary folder that is gone once it is loaded.

    Args:
        source: A C file next to this module (it includes ``kernels.h``).
        defines: ``-D`` flags, and any other compile flag (after the common ones, so
            they override them).
        what: Names the kernel in the log lines ("the paged decode kernel").
        environ: Where ``$CC`` and the cache folder are read.
        symbols: Every function the caller will take from the library
            (``twostroke_vector_bits`` is always checked): a library without one of them
            is built again, or refused with :class:`NativeBuildError`, never returned.
        dtype: The element type it is built for, for the cache's record.

    Returns:
        The loaded library and its path.

    Raises:
        NativeBuildError: no compiler, a failed compile or load, or a library without one
            of ``symbols``; the message says which.
        ValueError: ``TWOSTROKE_CPU_ISA`` names no rung, or one above this CPU's, or
            ``TWOSTROKE_CACHE_LIMIT`` is not a size.
    """
    flags = compile_flags(environ)
    compiler = _compiler(environ)
    cache = ArtifactCache.from_environment(environ)
    required = ("twostroke_vector_bits", *symbols)
    build = functools.partial(_build, compiler, flags, source, defines, what)
    with _build_lock:
        if cache is not None:
            entry = (
                cache.root
                / NATIVE_FOLDER
                / f"{source.stem}-{_identity(compiler, flags, source, defines)}"
            )
            provenance = Provenance(
                what="library",
                source=source.name,
                torch=torch.__version__,
                isa=cpu_personality(environ).describe(),
                dtype=None if dtype is None else str(dtype).removeprefix("torch."),
                detail=" ".join(defines) or None,
            )
            try:
                return _cached(cache, entry, build, what, required, provenance)
            except UnsafeCachePath as error:
                _warn_once(
                    f"twostroke: not using the cache for compiled kernels: {error}; each "
                    "start builds them in a private folder until it is fixed (`twostroke "
                    "cache clear` makes a folder of this user's private again)"
                )
        with tempfile.TemporaryDirectory(prefix="twostroke-native-") as folder:
            path = build(Path(folder))
            return _load(path, required), path  # the mapping outlives the file


def _cached(
    cache: ArtifactCache,
    entry: Path,
    build: Callable[[Path], Path],
    what: str,
    required: Sequence[str],
    provenance: Provenance,
) -> tuple[ctypes.CDLL, Path]:
    """The library of the cache entry ``entry``: loaded once the cache has checked it;
    built (again) when it is missing, refused or does not load.

    Raises:
        UnsafeCachePath: the cache is not this user's alone (nothing was loaded from it).
        NativeBuildError: the build fails, or what it built is refused too.
    """
    built_here = False
    while True:
        try:
            record = cache.open(entry)
            if record is not None:
                path = entry / _library_file(entry, record)
                return _load(path, required), path
        except (DamagedArtifact, NativeBuildError) as error:
            if built_here:
                raise NativeBuildError(f"the library just built is refused: {error}") from error
            _log.warning(
                "twostroke: building %s again: the cached library is refused (%s)", what, error
            )
            cache.discard(entry)
        if built_here:  # stored, and gone at once: another process cleared the cache
            raise NativeBuildError(f"the library built for {entry.name} left the cache")
        built_here = True
        with tempfile.TemporaryDirectory(prefix="twostroke-native-") as folder:
            built = build(Path(folder))
            if not cache.store(entry, functools.partial(_place, built), provenance=provenance):
                return _load(built, required), built  # a cache it cannot write: this build


def _library_file(entry: Path, record: Record) -> str:
    """The library's file name in its cache entry (named by its content)."""
    libraries = [name for name in record.files if name.endswith(".so")]
    if len(libraries) != 1:
        raise DamagedArtifact(entry, f"its record names {len(libraries)} libraries, not one")
    return libraries[0]


def _place(built: Path, folder: Path) -> None:
    """Fill a cache entry's temporary folder with the library ``built``.

    The file is named by its content, so a process that loaded an earlier library of this
    entry (its loader keeps one mapping per path) loads a rebuilt one afresh.
    """
    folder.mkdir(mode=0o700)
    digest = digest_file(built, "sha256")
    shutil.copyfile(built, folder / f"{built.stem}-{digest[:16]}.so")


@functools.cache
def _warn_once(message: str) -> None:
    _log.warning("%s", message)


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


def _identity(
    compiler: Sequence[str], flags: Sequence[str], source: Path, defines: Sequence[str]
) -> str:
    """A hash of everything that makes the library (the instruction-set flags included, so
    each personality has libraries of its own, and the headers beside the source, which it
    includes)."""
    headers = [source.with_name(header.name) for header in (HEADER, KERNELS_HEADER)]
    identity = b"\0".join(
        [
            source.read_bytes(),
            *(header.read_bytes() for header in headers if header.is_file()),
            " ".join([*flags, *defines, "|", *_LDFLAGS]).encode(),
            _compiler_identity(tuple(compiler)).encode(),
            _cpu_identity().encode(),
            torch.__version__.encode(),
        ]
    )
    return hashlib.sha256(identity).hexdigest()[:16]


def _build(
    compiler: Sequence[str],
    flags: Sequence[str],
    source: Path,
    defines: Sequence[str],
    what: str,
    folder: Path,
) -> Path:
    """Compile and link the library for ``defines`` in ``folder``, a folder of this build's
    own (so the object file of one build is never another's)."""
    started = time.perf_counter()
    _log.info("twostroke: compiling %s%s", what, f" ({' '.join(defines)})" if defines else "")
    objects = folder / f"{source.stem}.o"
    path = folder / f"{source.stem}.so"
    _run([*compiler, *flags, *defines, "-c", str(source), "-o", str(objects)])
    _run([*compiler, *_LDFLAGS, str(objects), "-o", str(path)])
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


def lookup(library: ctypes.CDLL, path: Path, names: Sequence[str]) -> list[Any]:
    """The functions ``names`` of a loaded library (their ctypes pointers), in order.

    For a kernel module's functions that only some builds have; :func:`compile_library`
    checks the ones every build has.

    Raises:
        NativeBuildError: the library lacks one of them (ctypes' ``AttributeError``,
            turned into the error every kernel module falls back on).
    """
    missing = [name for name in names if not hasattr(library, name)]
    if missing:
        raise NativeBuildError(f"{path} lacks {', '.join(missing)}")
    return [getattr(library, name) for name in names]


def bind(library: ctypes.CDLL, path: Path, name: str) -> Any:
    """The function ``name`` of a loaded library, its result and argument types set from
    its declaration in ``kernels.h`` (:func:`.header.declarations`).

    Raises:
        NativeBuildError: the library lacks it, or the header does not declare it (or
            holds C its reader does not read).
    """
    try:
        declaration = declarations().get(name)
    except HeaderError as error:
        raise NativeBuildError(f"{KERNELS_HEADER.name}: {error}") from error
    if declaration is None:
        raise NativeBuildError(f"{KERNELS_HEADER.name} does not declare {name}")
    [function] = lookup(library, path, [name])
    function.restype = declaration.restype
    function.argtypes = declaration.argtypes
    return function


def _load(path: Path, names: Sequence[str]) -> ctypes.CDLL:
    """Load a library and look up each of ``symbols`` in it.

    Raises:
        NativeBuildError: it does not load, or lacks one of ``symbols`` (a library from
            another source, or damaged).
    """
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeBuildError(f"cannot load {path}: {error}") from error
    lookup(library, path, names)
    return library


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
    for line in cpuinfo_text().splitlines(keepends=True):
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
            lines.append(line)
        if not line.strip() and lines:
            break  # the first processor describes them all
    return "".join(lines) or f"{platform.machine()} {platform.processor()}"
