"""What the CPU's personality makes of the kernels: the report of each decision
(``twostroke isa``), and the compiled libraries' instructions, under every rung."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.gpu.test_isa import CHILD_TIMEOUT, run_child
from twostroke.engine.kernels import build
from twostroke.engine.kernels.paged_attention import SOURCE as PAGED_DECODE
from twostroke.engine.models.report import cpu_report
from twostroke.gpu import isa
from twostroke.gpu.isa import ISA_ENV, cpu_personality, rung_named


def test_twostroke_isa_reports_the_capped_paths() -> None:
    """``twostroke isa`` under ``portable``: every decision took the capped path."""
    code = "import sys; from twostroke.engine.cli import main; sys.exit(main(['isa']))"
    report = dict(
        line.split(": ", 1) for line in run_child(code, **{ISA_ENV: "portable"}).splitlines()
    )
    assert report["personality"].startswith("portable (capped by TWOSTROKE_CPU_ISA")
    assert report["compile flags"] == ("-march=x86-64" if isa._is_x86() else "(compiler default)")
    assert report["aten"] == "DEFAULT"
    assert report["dtype auto"] == "float32"
    assert report["weights auto"] == "float32"
    assert report["bf16 projections"].startswith("oneDNN's")
    assert report["decode attention"] == "compiled, 128-bit vectors"


@pytest.mark.isa
def test_the_kernel_report_follows_this_runs_personality() -> None:
    """In this run (``make test`` runs it again under each lower rung), each decision takes
    the path of the personality's rung."""
    personality = cpu_personality()
    report = cpu_report()
    rung = personality.rung
    assert report.personality == personality
    if personality.capped:
        assert report.aten == rung.aten.upper()
        assert report.unapplied == ()
    assert report.dtype == (torch.bfloat16 if rung.bf16 else torch.float32)
    if not personality.fbgemm:
        assert report.weights == "float32"
    if not rung.bf16:
        assert report.projections.startswith("oneDNN's")
    if build.native_wanted():
        assert report.attention == f"compiled, {rung.vector_bits}-bit vectors"
    assert any(line.startswith("personality: ") for line in report.lines())


def compiled(rung: str, tmp_path: Path) -> Path:
    """The paged decode kernel at SmolLM2's shape (16-lane vectors where AVX-512 is) compiled
    for ``rung``, not loaded: a rung above this CPU's can be inspected too."""
    flags = (*build._CFLAGS, *rung_named(rung).march)
    defines = ["-DBLOCK_SIZE=16", "-DHEAD_DIM=64", "-DGROUP=3", "-DELEMENT_BF16"]
    compiler = build._compiler(os.environ)
    return build._build(compiler, flags, PAGED_DECODE, defines, "a test kernel", tmp_path)


def registers(library: Path) -> set[str]:
    """The kinds of vector register (xmm, ymm, zmm) the library's code names."""
    objdump = shutil.which("objdump")
    assert objdump is not None
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=True,
    ).stdout
    return set(re.findall(r"%([xyz]mm)\d+", listing))


@pytest.mark.skipif(not isa._is_x86(), reason="x86 instruction sets")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump to read the code")
def test_a_library_built_for_a_rung_uses_no_instruction_above_it(tmp_path: Path) -> None:
    """The flags reach the code: no AVX register below ``avx2``, no AVX-512 register below
    ``avx512`` (and the check sees them where they are allowed, so it can fail)."""
    assert registers(compiled("portable", tmp_path)) == {"xmm"}
    avx2 = registers(compiled("avx2", tmp_path))  # one build for both checks
    assert "zmm" not in avx2
    assert "ymm" in avx2
    assert "zmm" in registers(compiled("avx512", tmp_path))


@pytest.mark.isa
@pytest.mark.skipif(not isa._is_x86(), reason="x86 instruction sets")
def test_this_runs_libraries_are_built_for_its_personality(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library compiled in this run (``make test`` runs it again under each lower rung)
    was built with the rung's flags, says the rung's vector width, and its code names no
    register wider than that."""
    monkeypatch.setenv("TWOSTROKE_CACHE_DIR", str(tmp_path))
    personality = cpu_personality()
    assert build.compile_flags()[-len(personality.compile_flags) :] == personality.compile_flags
    library, path = build.compile_library(
        PAGED_DECODE, ["-DBLOCK_SIZE=16", "-DHEAD_DIM=64", "-DGROUP=3"], "a test kernel", os.environ
    )
    if personality.capped:
        assert build.vector_bits(library) == personality.rung.vector_bits
    if shutil.which("objdump") is not None:
        widest = {128: "xmm", 256: "ymm", 512: "zmm"}[build.vector_bits(library)]
        order = ["xmm", "ymm", "zmm"]
        allowed = set(order[: order.index(widest) + 1])
        assert registers(path) <= allowed
