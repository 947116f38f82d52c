"""The host as /proc describes it: the CPU's flags and name, and the memory available."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from twostroke.gpu import host

CPUINFO = (
    "processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
    "flags\t\t: fpu avx2 avx512f avx512_bf16\nbugs\t\t: spectre_v1\n\n"
    "processor\t: 1\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
    "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
)


def test_the_cpu_flags_and_name_are_read_from_cpuinfo() -> None:
    assert host.cpu_flags(CPUINFO) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert host.cpu_model_name(CPUINFO) == "AMD EPYC 9R14 96-Core Processor"
    assert host.cpu_flags("") == frozenset()
    assert host.cpu_model_name("processor\t: 0\n") is None


def test_this_machine_is_read_when_no_text_is_given() -> None:
    assert isinstance(host.cpu_flags(), frozenset)
    name = host.cpu_model_name()
    assert name is None or name


def test_without_proc_the_cpu_is_unknown_and_sysconf_gives_the_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    monkeypatch.setattr(host, "_CPUINFO", missing)
    monkeypatch.setattr(host, "_MEMINFO", missing)
    assert host.cpu_flags() == frozenset()
    assert host.cpu_model_name() is None
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < host.available_memory() <= total


def test_cpuinfo_is_read_once_however_many_ask(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    monkeypatch.setattr(host, "_CPUINFO", cpuinfo)
    reads: list[Path] = []
    read_text = Path.read_text

    def counted(path: Path, *args: object, **kwargs: object) -> str:
        reads.append(path)
        return read_text(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", counted)
    assert host.cpu_flags() == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert host.cpu_model_name() == "AMD EPYC 9R14 96-Core Processor"
    assert host.cpu_flags() == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert reads.count(cpuinfo) == 1
    assert host.cpuinfo_text() == CPUINFO  # the reader the other modules call
    assert reads.count(cpuinfo) == 1
