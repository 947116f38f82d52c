"""Every public error of twostroke is importable from ``twostroke.engine`` and documented."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil

import pytest

import twostroke.engine
from twostroke.engine import (
    DeviceUnavailable,
    EngineError,
    InvalidTransition,
    ModelLoadError,
    RequestRejected,
    SchedulerError,
    WeightError,
)

ROOT = pathlib.Path(__file__).parents[2]

#: Public (in their module's ``__all__``) but never seen by a caller of the engine.
NOT_EXPORTED = {
    # The server's own signals: one becomes an HTTP error response, the other ends a stream
    # whose client went away; neither leaves the server.
    "twostroke.engine.server.errors.ApiError",
    "twostroke.engine.server.sse.Disconnected",
    # The wire's own signal: each side turns it into RequestRejected, a ValueError or a
    # FinishedPart split before it leaves the coordinator or the replica.
    "twostroke.engine.coordinator.frames.FrameTooLarge",
    # The bench's own signal: a peer's child process failed; the bench records it as that
    # system's reason for not running, and nothing outside `twostroke bench` sees it.
    "twostroke.engine.bench.child.ChildError",
    # The native kernel's own signal: a runner that meets it logs it once and attends with
    # the bag kernel instead; only build_kernel's own callers (the tests) see it.
    "twostroke.engine.kernels.build.NativeBuildError",
    # The header reader's refusal of C it does not read: build.bind and the stack turn it
    # into NativeBuildError at once; only header's own callers (the tests) see it.
    "twostroke.engine.kernels.header.HeaderError",
    # Its kind for a CPU the bfloat16 projection does not run on: the model logs it and
    # keeps oneDNN's products; only build_projection's own callers (the tests) see it.
    "twostroke.engine.kernels.projection.ProjectionUnsupported",
    # The artifact cache's refusals of an entry (damaged, or another user's to write): the
    # loader, the tokenizer and the kernels log them, remove the entry and make it again
    # (or build privately); only ArtifactCache.open's own callers see them.
    "twostroke.engine.artifacts.records.UnusableArtifact",
    "twostroke.engine.artifacts.records.DamagedArtifact",
    "twostroke.engine.artifacts.records.UnsafeCachePath",
    # The chat template renderer's own signal: the tokenizer turns it into ChatTemplateError
    # (a 400) for a request, and into TokenizerLoadError for the probe rendered at load.
    "twostroke.engine.text.chat_template.TemplateBoundExceeded",
    # The server's stores' own failures (the SQLite files of stored responses and of
    # batches): the server logs them and answers a 500 (response_store_failed,
    # batch_store_failed); no caller of the engine meets them.
    "twostroke.engine.server.response_store.ResponseStoreError",
    "twostroke.engine.server.batch_store.BatchStoreError",
    # A test oracle (an AssertionError): a scheduling bug the simulated KV cache caught.
    "twostroke.states.simulation.SimulationError",
}


def public_errors() -> dict[str, type[BaseException]]:
    """Every exception class named in the ``__all__`` of a module of the three packages.

    Warnings are not errors (nothing to catch): they stay where they are defined.
    """
    found: dict[str, type[BaseException]] = {}
    for package in ("twostroke.states", "twostroke.gpu", "twostroke.engine"):
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, f"{package}."):
            module = importlib.import_module(info.name)
            for name in getattr(module, "__all__", ()):
                value = getattr(module, name)
                if (
                    inspect.isclass(value)
                    and issubclass(value, BaseException)
                    and not issubclass(value, Warning)
                    and value.__module__ == module.__name__
                ):
                    found[f"{module.__name__}.{name}"] = value
    return found


ERRORS = public_errors()


def test_the_scan_finds_the_errors_of_every_layer() -> None:
    assert {
        "twostroke.states.errors.InvalidTransition",
        "twostroke.gpu.device.DeviceUnavailable",
        "twostroke.engine.checkpoints.errors.ModelLoadError",
    } <= ERRORS.keys()
    assert ERRORS.keys() >= NOT_EXPORTED  # the excused ones still exist


@pytest.mark.parametrize("qualified", sorted(ERRORS.keys() - NOT_EXPORTED))
def test_every_public_error_is_exported_from_twostroke_engine(qualified: str) -> None:
    error = ERRORS[qualified]
    assert getattr(twostroke.engine, error.__name__, None) is error, qualified
    assert error.__name__ in twostroke.engine.__all__


@pytest.mark.parametrize("qualified", sorted(ERRORS.keys() - NOT_EXPORTED))
def test_every_exported_error_is_in_the_table_of_docs_errors_md(qualified: str) -> None:
    table = (ROOT / "docs" / "errors.md").read_text()
    assert f"| `{ERRORS[qualified].__name__}` |" in table


def test_the_roots() -> None:
    """Errors raised on purpose share one root, but gpu's (it may not import states)."""
    for error in (InvalidTransition, RequestRejected, SchedulerError, ModelLoadError, WeightError):
        assert issubclass(error, EngineError)
    assert issubclass(RequestRejected, ValueError)
    assert issubclass(WeightError, ValueError)
    assert issubclass(SchedulerError, RuntimeError)
    assert issubclass(DeviceUnavailable, RuntimeError)
    assert not issubclass(DeviceUnavailable, EngineError)
