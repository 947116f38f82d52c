"""Shared test configuration: both anyio backends, hypothesis profiles, doc examples."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None)
# `make test`: sized for a 2-core AVX2 machine with another job busy on one core; the slowest
# property test (a scheduler machine) takes 10.6 s with coverage there when quiet, and has a
# 300 s hang tripwire for when the rest of `make test` runs beside it (tests/states/conftest.py).
settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Hunting rare interleavings: `make test HYPOTHESIS_PROFILE=thorough` (with --timeout=0).
settings.register_profile(
    "thorough",
    max_examples=500,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with slow tests first; skip the tests marked ``cuda`` where torch sees no GPU
    (scripts/gpu_check.sh runs them)."""
    _slow_modules_first(items)
    needs_gpu = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not needs_gpu:
        return
    import torch  # only when a collected test needs a GPU

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in needs_gpu:
        item.add_marker(skip)


def _slow_modules_first(items: list[pytest.Item]) -> None:
    """Run the modules that hold ``slow`` (real-model, Ray) tests before the rest.

    xdist's ``--dist loadscope --no-loadscope-reorder`` (the Makefile's) hands modules to
    its workers in collection order, each worker taking the next when it is done (without
    ``--no-loadscope-reorder``, xdist 3.6 and later hand out the modules with the most tests
    first, whatever this order). A long module collected late ran alone at the
    end while the other worker sat idle; handed out first, the long modules are spread over
    both workers and the many short ones fill the gaps. A stable sort: the order of the
    modules within each group and of the tests within each module is kept.
    """

    def module(item: pytest.Item) -> str | None:
        found = getattr(item, "module", None)
        return getattr(found, "__name__", None)

    slow = {module(item) for item in items if item.get_closest_marker("slow") is not None}
    slow.discard(None)
    items.sort(key=lambda item: module(item) not in slow)


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """Every async test runs on asyncio and on trio."""
    return request.param


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread for a whole test module, then restore the count.

    Apply with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``. The test machine
    has two cores shared with other test runs; a two-thread torch waits at every parallel
    region for a thread the OS has descheduled and runs several times slower.
    """
    from twostroke.gpu.threads import torch_threads  # torch only where a module asks

    with torch_threads(1):
        yield
