"""The CPU's instruction set, and the personality that runs the program as if it had less.

twostroke's CPU code takes a different path on each instruction set: its compiled kernels
are built for the machine (``-march``), torch's own kernels dispatch on the CPU (ATen's
``ATEN_CPU_CAPABILITY``, oneDNN, MKL, fbgemm), and policies read the CPU's flags (bfloat16 is
the fast dtype only with AVX512-BF16). A machine runs one of those paths; a user's laptop
may run another that no test ever ran. The **personality** closes that gap: one setting,
:data:`ISA_ENV` (``TWOSTROKE_CPU_ISA=avx2``), makes the whole program behave as on a CPU
whose instruction set stops at that rung of :data:`RUNGS`:

| rung | compiled (`-march=`) | ATen | oneDNN | MKL | fbgemm |
|---|---|---|---|---|---|
| `portable` | `x86-64` (SSE2) | `default` | `SSE41` | `SSE4_2` | none |
| `avx2` | `x86-64-v3` | `avx2` | `AVX2` | `AVX2` | `AVX2` |
| `avx512` | `x86-64-v4` | `avx512` | `AVX512_CORE` | `AVX512` | `AVX512` |
| `avx512_vnni` | `x86-64-v4`, VNNI | `avx512` | `AVX512_CORE_VNNI` | `AVX512_E1` | `AVX512_E1` |
| `avx512_bf16` | ..., BF16 | `avx512` | `AVX512_CORE_BF16` | `AVX512_E3` | `AVX512_E1` |

and twostroke's own policies follow it: ``dtype="auto"`` is bfloat16 only on
``avx512_bf16``, the compiled bfloat16 projections need it too, fbgemm's reduced-precision
weights need ``avx2`` (fbgemm has nothing below it). Unset (or ``native``), nothing is
capped and kernels compile with ``-march=native``. A personality can only lower the
instruction set: asking for more than the CPU has is a :class:`ValueError`.

It is a user-facing option as much as a test tool: "run as if on an older CPU" is how a user
works around a kernel that misbehaves on theirs, and how ``make test`` runs the tests marked
``isa`` again on the lower rungs (:func:`rungs_to_test`), so that a test written on an
AVX-512 machine also proves the AVX2 and portable paths.

The libraries read their variables once, when they first dispatch, so :func:`apply` writes
them into the environment when this module is imported (``twostroke.gpu`` imports it first),
before anything of twostroke runs a torch op; child processes (replicas, bench peers)
inherit them. Where torch already dispatched before that, ATen keeps its first choice:
:meth:`Personality.unapplied` says so.
This module imports neither torch nor anything that does.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping, MutableMapping

import attrs

from twostroke.gpu.host import cpu_flags

__all__ = [
    "APPLIED_AT_IMPORT",
    "ISA_ENV",
    "LIBRARY_VARIABLES",
    "NATIVE",
    "RUNGS",
    "TESTED_RUNGS",
    "Personality",
    "Rung",
    "apply",
    "cpu_personality",
    "machine_rung",
    "rung_named",
    "rungs_to_test",
]

#: The environment variable that caps the instruction set (see the module).
ISA_ENV = "TWOSTROKE_CPU_ISA"

#: Its value (or unset) for no cap: the machine's own instruction set.
NATIVE = "native"

#: The variables :func:`apply` writes for a capped personality, one per library.
LIBRARY_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "FBGEMM_ENABLE_INSTRUCTIONS",
)


@attrs.frozen(repr=False)
class Rung:
    """One instruction set of the ladder, and what each library is capped at on it.

    Attributes:
        name: The value of :data:`ISA_ENV` that asks for it.
        requires: The ``/proc/cpuinfo`` flags a CPU needs to run it.
        march: The compile flags of twostroke's kernels on x86-64.
        aten: ``ATEN_CPU_CAPABILITY``.
        onednn: ``ONEDNN_MAX_CPU_ISA``.
        mkl: ``MKL_ENABLE_INSTRUCTIONS``.
        fbgemm: ``FBGEMM_ENABLE_INSTRUCTIONS``; ``None``: fbgemm does not run (it needs AVX2).
        bf16: Whether bfloat16 arithmetic is native (AVX512-BF16).
        vector_bits: The widest vectors compiled code may use (128: SSE).
    """

    name: str
    requires: frozenset[str]
    march: tuple[str, ...]
    aten: str
    onednn: str
    mkl: str
    fbgemm: str | None
    bf16: bool
    vector_bits: int

    @property
    def rank(self) -> int:
        """Its place on the ladder, from 0 (``portable``)."""
        return RUNGS.index(self)

    def __repr__(self) -> str:
        return f"<Rung {self.name}>"


_AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

#: The ladder, lowest first. The x86-64 microarchitecture levels of GCC 11+ and clang 12+
#: name the first three; the last two add the extensions twostroke's and fbgemm's kernels
#: test for (VNNI changes fbgemm's int8 products: without it, pairs of 8-bit products
#: saturate in 16 bits).
RUNGS: tuple[Rung, ...] = (
    Rung(
        name="portable",
        requires=frozenset(),
        march=("-march=x86-64",),
        aten="default",
        onednn="SSE41",
        mkl="SSE4_2",
        fbgemm=None,
        bf16=False,
        vector_bits=128,
    ),
    Rung(
        name="avx2",
        requires=_AVX2_FLAGS,
        march=("-march=x86-64-v3",),
        aten="avx2",
        onednn="AVX2",
        mkl="AVX2",
        fbgemm="AVX2",
        bf16=False,
        vector_bits=256,
    ),
    Rung(
        name="avx512",
        requires=_AVX512_FLAGS,
        march=("-march=x86-64-v4",),
        aten="avx512",
        onednn="AVX512_CORE",
        mkl="AVX512",
        fbgemm="AVX512",
        bf16=False,
        vector_bits=512,
    ),
    Rung(
        name="avx512_vnni",
        requires=_AVX512_FLAGS | {"avx512_vnni"},
        march=("-march=x86-64-v4", "-mavx512vnni"),
        aten="avx512",
        onednn="AVX512_CORE_VNNI",
        mkl="AVX512_E1",
        fbgemm="AVX512_E1",
        bf16=False,
        vector_bits=512,
    ),
    Rung(
        name="avx512_bf16",
        requires=_AVX512_FLAGS | {"avx512_vnni", "avx512_bf16"},
        march=("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
        aten="avx512",
        onednn="AVX512_CORE_BF16",
        mkl="AVX512_E3",
        fbgemm="AVX512_E1",  # fbgemm has no bfloat16 rung of its own
        bf16=True,
        vector_bits=512,
    ),
)

#: The rungs ``make test`` runs the ``isa`` tests on again, where they are below the
#: machine's (:func:`rungs_to_test`): each has code paths of its own in twostroke's kernels
#: (``paged_decode.c``'s AVX2 loads and its scalar loops) and in the libraries (fbgemm has
#: nothing below AVX2; oneDNN packs no bfloat16 without AVX-512), and between them they are
#: what most machines without AVX-512 run.
TESTED_RUNGS = ("avx2", "portable")


def rung_named(name: str) -> Rung:
    """The rung called ``name``.

    Raises:
        ValueError: no rung has that name; the message lists them.
    """
    for rung in RUNGS:
        if rung.name == name:
            return rung
    names = ", ".join(repr(rung.name) for rung in RUNGS)
    raise ValueError(f"{ISA_ENV} must be {NATIVE!r} (or unset) or one of {names}, got {name!r}")


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def machine_rung(flags: frozenset[str] | None = None, *, x86: bool | None = None) -> Rung:
    """The highest rung this CPU runs: every flag it requires is among the CPU's.

    Off x86, or where no flag is known (not Linux), only ``portable``.

    Args:
        flags: The CPU's flags; ``None`` reads this machine's (:func:`.host.cpu_flags`).
        x86: Whether the CPU is x86; ``None`` asks :mod:`platform`.
    """
    known = cpu_flags() if flags is None else flags
    if not (_is_x86() if x86 is None else x86):
        return RUNGS[0]
    return [rung for rung in RUNGS if rung.requires <= known][-1]


@attrs.frozen(repr=False)
class Personality:
    """The instruction set this process runs as: the machine's, or a rung below it.

    Attributes:
        rung: The rung every path follows (the machine's when not capped).
        machine: The machine's own rung.
        capped: Whether :data:`ISA_ENV` asked for it (else: ``native``).
        x86: Whether the CPU is x86 (elsewhere, only the compile flags and ATen are capped).
        amx_tiles: Whether the CPU has AMX's bfloat16 tiles (``amx_tile``, ``amx_bf16``),
            which oneDNN's bfloat16 matrix products use where nothing caps it (:attr:`amx`).
    """

    rung: Rung
    machine: Rung
    capped: bool
    x86: bool = True
    amx_tiles: bool = False

    @property
    def amx(self) -> bool:
        """Whether oneDNN's bfloat16 products run on AMX tiles: the CPU has them and the
        personality caps nothing (every rung caps oneDNN below AMX, ``AVX512_CORE_BF16`` at
        the top)."""
        return self.amx_tiles and self.x86 and not self.capped

    @property
    def name(self) -> str:
        """``native``, or the rung's name."""
        return self.rung.name if self.capped else NATIVE

    @property
    def compile_flags(self) -> tuple[str, ...]:
        """The instruction-set flags twostroke's kernels compile with.

        ``-march=native`` when not capped. Capped off x86, only ``portable`` exists, and
        it is the compiler's own default target (no flag).
        """
        if not self.capped:
            return ("-march=native",)
        return self.rung.march if self.x86 else ()

    @property
    def bf16(self) -> bool:
        """Whether bfloat16 arithmetic counts as native (the rung's; off x86, never)."""
        return self.rung.bf16 and self.x86

    @property
    def fbgemm(self) -> bool:
        """Whether fbgemm's kernels (reduced-precision weights) run: AVX2 and up on x86."""
        return self.rung.fbgemm is not None and self.x86

    def environment(self) -> dict[str, str]:
        """The libraries' variables for this personality (none when not capped)."""
        if not self.capped:
            return {}
        if not self.x86:  # oneDNN, MKL and fbgemm name other ISAs elsewhere
            return {"ATEN_CPU_CAPABILITY": self.rung.aten}
        variables = {
            "ATEN_CPU_CAPABILITY": self.rung.aten,
            "ONEDNN_MAX_CPU_ISA": self.rung.onednn,
            "MKL_ENABLE_INSTRUCTIONS": self.rung.mkl,
        }
        if self.rung.fbgemm is not None:
            variables["FBGEMM_ENABLE_INSTRUCTIONS"] = self.rung.fbgemm
        return variables

    def unapplied(self, aten_capability: str) -> list[str]:
        """What of this personality a library did not take, in words (empty: all of it).

        ATen is the one library that says what it dispatches on; it chose before
        :func:`apply` ran when torch ran an op before ``twostroke.gpu`` was imported.

        Args:
            aten_capability: ``torch.backends.cpu.get_cpu_capability()``.
        """
        if not self.capped or aten_capability.lower() == self.rung.aten:
            return []
        return [
            f"ATen dispatches on {aten_capability}, not {self.rung.aten.upper()} (torch ran "
            f"before twostroke.gpu was imported; set {ISA_ENV} before starting Python)"
        ]

    def __repr__(self) -> str:
        return f"<Personality {self.describe()}>"

    def describe(self) -> str:
        """One line for logs and reports: ``avx2 (capped; this CPU: avx512_bf16)``."""
        if self.capped:
            return f"{self.rung.name} (capped by {ISA_ENV}; this CPU: {self.machine.name})"
        return f"native ({self.machine.name})"


def cpu_personality(environ: Mapping[str, str] | None = None) -> Personality:
    """The personality :data:`ISA_ENV` asks for on this machine.

    Args:
        environ: Where :data:`ISA_ENV` is read (``os.environ`` if ``None``).

    Raises:
        ValueError: an unknown rung, or one above this CPU's; the message names the
            variable, the value and the rungs that are allowed.
    """
    return _personality(_requested(os.environ if environ is None else environ))


def _requested(environ: Mapping[str, str]) -> str:
    return environ.get(ISA_ENV, "").strip().lower() or NATIVE


@functools.cache
def _personality(requested: str) -> Personality:
    x86 = _is_x86()
    machine = machine_rung(x86=x86)
    amx = x86 and {"amx_tile", "amx_bf16"} <= cpu_flags()
    if requested == NATIVE:
        return Personality(machine, machine, capped=False, x86=x86, amx_tiles=amx)
    rung = rung_named(requested)
    if rung.rank > machine.rank:
        below = ", ".join(repr(r.name) for r in RUNGS[: machine.rank + 1])
        raise ValueError(
            f"{ISA_ENV}={requested!r} is above this CPU's instruction set ({machine.name!r}): "
            f"a personality can only lower it; this CPU runs {below}"
        )
    return Personality(rung, machine, capped=True, x86=x86, amx_tiles=amx)


def apply(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Write the libraries' variables for :data:`ISA_ENV`'s personality into ``environ``.

    Called when ``twostroke.gpu`` is imported, before twostroke runs any torch op. The
    personality decides: a library variable the user set is overwritten by a capped
    personality, and left alone without one. An invalid :data:`ISA_ENV` writes nothing
    here; :func:`cpu_personality` raises where the program first asks.

    Args:
        environ: The environment to change (``os.environ`` if ``None``).

    Returns:
        The variables written.
    """
    env = os.environ if environ is None else environ
    if _requested(env) == NATIVE:  # the common case reads no /proc/cpuinfo at import
        return {}
    try:
        variables = cpu_personality(env).environment()
    except ValueError:
        return {}
    env.update(variables)
    return variables


def rungs_to_test(machine: Rung | None = None) -> list[str]:
    """The rungs of :data:`TESTED_RUNGS` below ``machine``: what ``make test`` runs the
    ``isa`` tests on again.

    Args:
        machine: The machine's rung (:func:`machine_rung` if ``None``).
    """
    top = machine_rung() if machine is None else machine
    return [name for name in TESTED_RUNGS if rung_named(name).rank < top.rank]


#: The variables importing this module wrote (:func:`apply`): ``twostroke.gpu`` imports it
#: before anything that runs torch.
APPLIED_AT_IMPORT = apply()
