"""The CPU personality (TWOSTROKE_CPU_ISA): the ladder, the machine's rung, the caps it writes,
and that a process started under it runs as the lower CPU (ATen, oneDNN's cap, the dtype,
fbgemm's weights). tests/engine/kernels/test_report.py shows the compiled kernels and the
kernel report follow it too."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from twostroke.gpu import isa
from twostroke.gpu.host import cpu_flags
from twostroke.gpu.isa import (
    ISA_ENV,
    LIBRARY_VARIABLES,
    RUNGS,
    Personality,
    apply,
    cpu_personality,
    machine_rung,
    rung_named,
    rungs_to_test,
)

AVX2_FLAGS = "fpu sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512bw avx512cd avx512dq avx512vl"

#: A child Python is given this long to import torch and twostroke (2-5 s when quiet); the
#: margin covers a machine whose both cores are busy with other work.
CHILD_TIMEOUT = 120


@pytest.fixture
def fresh_personality() -> Iterator[None]:
    """Forget the personalities this process resolved, before and after."""
    isa._personality.cache_clear()
    yield
    isa._personality.cache_clear()


@pytest.fixture
def avx512_machine(fresh_personality: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process runs on an x86 CPU with AVX-512 (F, BW, CD, DQ, VL) and nothing above."""
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(AVX512_FLAGS.split()))
    monkeypatch.setattr(isa, "_is_x86", lambda: True)


def test_the_ladder_is_ordered_and_each_rung_holds_the_one_below() -> None:
    assert [rung.name for rung in RUNGS] == [
        "portable",
        "avx2",
        "avx512",
        "avx512_vnni",
        "avx512_bf16",
    ]
    for lower, higher in itertools.pairwise(RUNGS):
        assert lower.rank + 1 == higher.rank
        assert lower.requires <= higher.requires
        assert lower.vector_bits <= higher.vector_bits
    assert [rung.name for rung in RUNGS if rung.bf16] == ["avx512_bf16"]
    assert [rung.name for rung in RUNGS if rung.fbgemm is None] == ["portable"]
    assert repr(RUNGS[1]) == "<Rung avx2>"


def test_an_unknown_rung_is_refused_by_name() -> None:
    message = (
        "TWOSTROKE_CPU_ISA must be 'native' (or unset) or one of 'portable', 'avx2', 'avx512', "
        "'avx512_vnni', 'avx512_bf16', got 'avx3'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        rung_named("avx3")


@pytest.mark.parametrize(
    ("flags", "x86", "expected"),
    [
        ("", True, "portable"),  # no /proc/cpuinfo: nothing is known
        ("fpu sse4_2 avx avx2", True, "portable"),  # AVX2 without FMA is no x86-64-v3
        (AVX2_FLAGS, True, "avx2"),
        (AVX512_FLAGS, True, "avx512"),
        (AVX512_FLAGS + " avx512_bf16", True, "avx512"),  # bf16 without VNNI: no CPU is so
        (AVX512_FLAGS + " avx512_vnni", True, "avx512_vnni"),
        (AVX512_FLAGS + " avx512_vnni avx512_bf16 amx_bf16", True, "avx512_bf16"),
        (AVX512_FLAGS + " avx512_vnni avx512_bf16", False, "portable"),  # not x86
    ],
)
def test_the_machine_rung_is_the_highest_whose_flags_it_has(
    flags: str, x86: bool, expected: str
) -> None:
    assert machine_rung(frozenset(flags.split()), x86=x86).name == expected


@pytest.mark.usefixtures("avx512_machine")
def test_a_personality_lowers_the_instruction_set_and_never_raises_it() -> None:
    native_one = cpu_personality({})
    assert (native_one.name, native_one.rung.name, native_one.capped) == ("native", "avx512", False)
    assert native_one.compile_flags == ("-march=native",)
    assert native_one.environment() == {}
    assert native_one.describe() == "native (avx512)"
    assert cpu_personality({ISA_ENV: " Native "}) == native_one
    capped = cpu_personality({ISA_ENV: "AVX2"})  # any case, any surrounding space
    assert (capped.name, capped.machine.name, capped.capped) == ("avx2", "avx512", True)
    assert capped.compile_flags == ("-march=x86-64-v3",)
    assert capped.environment() == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert repr(capped) == "<Personality avx2 (capped by TWOSTROKE_CPU_ISA; this CPU: avx512)>"
    portable = cpu_personality({ISA_ENV: "portable"})
    assert "FBGEMM_ENABLE_INSTRUCTIONS" not in portable.environment()  # fbgemm has no SSE path
    assert not portable.fbgemm
    assert not portable.bf16
    message = (
        "TWOSTROKE_CPU_ISA='avx512_bf16' is above this CPU's instruction set ('avx512'): a "
        "personality can only lower it; this CPU runs 'portable', 'avx2', 'avx512'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        cpu_personality({ISA_ENV: "avx512_bf16"})


def test_off_x86_only_aten_is_capped_and_the_compiler_keeps_its_default() -> None:
    portable = rung_named("portable")
    personality = Personality(portable, portable, capped=True, x86=False)
    assert personality.compile_flags == ()
    assert personality.environment() == {"ATEN_CPU_CAPABILITY": "default"}
    assert not personality.fbgemm
    native_one = Personality(portable, portable, capped=False, x86=False)
    assert native_one.compile_flags == ("-march=native",)


@pytest.mark.usefixtures("avx512_machine")
def test_apply_writes_the_caps_a_capped_personality_asks_for() -> None:
    environ = {ISA_ENV: "portable", "ATEN_CPU_CAPABILITY": "avx512"}  # the personality wins
    written = apply(environ)
    assert written == {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    }
    assert environ == {ISA_ENV: "portable", **written}
    untouched = {"ATEN_CPU_CAPABILITY": "avx2"}  # no personality: the user's choice stays
    assert apply(untouched) == {}
    assert untouched == {"ATEN_CPU_CAPABILITY": "avx2"}
    invalid = {ISA_ENV: "avx3"}  # written nowhere; refused where the program first asks
    assert apply(invalid) == {}
    assert invalid == {ISA_ENV: "avx3"}


def test_the_rungs_make_test_runs_again_are_those_below_the_machine() -> None:
    assert rungs_to_test(rung_named("avx512_bf16")) == ["avx2", "portable"]
    assert rungs_to_test(rung_named("avx512")) == ["avx2", "portable"]
    assert rungs_to_test(rung_named("avx2")) == ["portable"]
    assert rungs_to_test(rung_named("portable")) == []


def test_aten_keeps_its_choice_when_torch_dispatched_before_the_personality() -> None:
    avx2 = rung_named("avx2")
    capped = Personality(avx2, rung_named("avx512"), capped=True)
    assert capped.unapplied("AVX2") == []
    [line] = capped.unapplied("AVX512")
    assert line.startswith("ATen dispatches on AVX512, not AVX2 (torch ran before")
    assert Personality(avx2, avx2, capped=False).unapplied("AVX512") == []


def run_child(code: str, **environment: str) -> str:
    """Run ``code`` in a fresh Python with ``environment`` added; its standard output."""
    env = {**os.environ, **environment}
    for name in (ISA_ENV, *LIBRARY_VARIABLES):  # only what the test asks for
        if name not in environment:
            env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


CAPPED_CHILD = """
import os, torch, twostroke.gpu
from twostroke.gpu.dtype import default_dtype
from twostroke.gpu.isa import cpu_personality
from twostroke.engine.models.quantization import kernel_available
print(torch.backends.cpu.get_cpu_capability())
print(os.environ.get("ONEDNN_MAX_CPU_ISA"))
print(default_dtype(torch.device("cpu")))
print(kernel_available("fp16", torch.device("cpu")))
print(cpu_personality().unapplied(torch.backends.cpu.get_cpu_capability()))
"""


def test_a_process_started_under_portable_runs_as_a_cpu_without_avx() -> None:
    """The one setting reaches ATen, oneDNN's cap, the dtype and fbgemm's weights; a child
    process inherits it (the replicas and the bench peers do)."""
    lines = run_child(CAPPED_CHILD, **{ISA_ENV: "portable"}).splitlines()
    assert lines == ["DEFAULT", "SSE41", "torch.float32", "False", "[]"]


TORCH_FIRST_CHILD = """
import torch
torch.ones(4).exp()  # ATen chooses its kernels here, before twostroke
import twostroke.gpu
from twostroke.gpu.isa import cpu_personality
print(cpu_personality().unapplied(torch.backends.cpu.get_cpu_capability()))
"""


def test_torch_that_ran_before_twostroke_keeps_its_choice_and_it_is_said() -> None:
    if machine_rung().name == "portable":
        pytest.skip("this CPU has no rung above portable to keep")
    said = run_child(TORCH_FIRST_CHILD, **{ISA_ENV: "portable"})
    assert "ATen dispatches on" in said
    assert "not DEFAULT" in said


def test_amx_counts_only_where_nothing_caps_onednn() -> None:
    """oneDNN's bfloat16 products use AMX tiles where the CPU has them and no rung caps it
    (every rung's oneDNN cap is below AMX); off x86 there are none."""
    top = rung_named("avx512_bf16")
    assert Personality(top, top, capped=False, amx_tiles=True).amx
    assert not Personality(top, top, capped=False, amx_tiles=False).amx
    assert not Personality(top, top, capped=True, amx_tiles=True).amx
    assert not Personality(top, top, capped=False, x86=False, amx_tiles=True).amx
    assert cpu_personality().amx == (
        not cpu_personality().capped and {"amx_tile", "amx_bf16"} <= cpu_flags()
    )
