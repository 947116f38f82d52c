"""twostroke's engine: the two strokes, the public async API, models, server and CLI."""

from twostroke.engine.config import EngineConfig
from twostroke.engine.coordinator import Coordinator, CoordinatorStatistics
from twostroke.engine.engine import Engine, EngineStatistics
from twostroke.engine.errors import (
    EngineClosed,
    EngineDead,
    EngineError,
    ReplicaFailed,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
)
from twostroke.engine.handle import RequestHandle
from twostroke.engine.llm import LLM
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.states.params import SamplingParams
from twostroke.states.request import FinishReason

__all__ = [
    "LLM",
    "Coordinator",
    "CoordinatorStatistics",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineDead",
    "EngineError",
    "EngineStatistics",
    "FinishReason",
    "ReplicaFailed",
    "RequestCancelled",
    "RequestFailed",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "Usage",
]
