"""twostroke's engine: the two strokes, the public async API, models, server and CLI."""

from twostroke.engine.artifacts.cache import InvalidCacheLimit, UnmarkedCache
from twostroke.engine.checkpoints.loader import BlockTypeUnsupported, ModelLoadError
from twostroke.engine.config import EngineConfig
from twostroke.engine.coordinator import Coordinator, CoordinatorConfig, CoordinatorStatistics
from twostroke.engine.coordinator.auth import HandshakeFailed
from twostroke.engine.coordinator.frames import FrameError
from twostroke.engine.engine import Engine
from twostroke.engine.errors import (
    CompletionAlreadySet,
    CompletionError,
    CompletionNotDone,
    ConstraintFailed,
    ConstraintRejected,
    DeviceUnavailable,
    EngineClosed,
    EngineDead,
    EngineError,
    EngineOverloaded,
    ForwardThreadClosed,
    InvalidTransition,
    MatcherError,
    NoLiveReplica,
    ReplicaFailed,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
    SchedulerError,
    StructuredOutputUnavailable,
)
from twostroke.engine.handle import RequestHandle
from twostroke.engine.kernels.selection import DeterminismUnavailable
from twostroke.engine.llm import LLM
from twostroke.engine.models.llama import WeightError
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.engine.runners.torch import RunnerError
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.structured.masks import MasksAbandoned
from twostroke.engine.text.detokenizer import DetokenizerError
from twostroke.engine.text.tokenizer import ChatTemplateError, TokenizerLoadError
from twostroke.states.constraints import AnyJsonObject, Choice, Grammar, JsonSchema, Regex
from twostroke.states.params import SamplingParams
from twostroke.states.request import FinishReason

__all__ = [
    "LLM",
    "AnyJsonObject",
    "BlockTypeUnsupported",
    "ChatTemplateError",
    "Choice",
    "CompletionAlreadySet",
    "CompletionError",
    "CompletionNotDone",
    "ConstraintFailed",
    "ConstraintRejected",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorStatistics",
    "Delta",
    "DeterminismUnavailable",
    "DetokenizerError",
    "DeviceUnavailable",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineDead",
    "EngineError",
    "EngineOverloaded",
    "EngineStatistics",
    "FinishReason",
    "ForwardThreadClosed",
    "FrameError",
    "Grammar",
    "HandshakeFailed",
    "InvalidCacheLimit",
    "InvalidTransition",
    "JsonSchema",
    "MasksAbandoned",
    "MatcherError",
    "ModelLoadError",
    "NoLiveReplica",
    "Regex",
    "ReplicaFailed",
    "RequestCancelled",
    "RequestFailed",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RunnerError",
    "SamplingParams",
    "SchedulerError",
    "StructuredOutputUnavailable",
    "TokenizerLoadError",
    "UnmarkedCache",
    "Usage",
    "WeightError",
]
