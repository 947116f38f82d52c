"""twostroke's engine: the two strokes, the public async API, models, server and CLI."""

from twostroke.engine.artifacts.cache import InvalidCacheLimit, UnmarkedCache
from twostroke.engine.checkpoints.errors import BlockTypeUnsupported, ModelLoadError
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
from twostroke.engine.llm import LLM
from twostroke.engine.models.choice import DeterminismUnavailable
from twostroke.engine.models.decoder import WeightError
from twostroke.engine.outputs import Delta, RequestMetrics, RequestOutput, Usage
from twostroke.engine.runners.torch import RunnerError
from twostroke.engine.statistics import EngineStatistics
from twostroke.engine.structured.masks import MasksAbandoned
from twostroke.engine.synthetic.cached import SyntheticCacheUnavailable
from twostroke.engine.synthetic.gguf_file import QuantizerUnavailable
from twostroke.engine.synthetic.shapes import UnknownShape
from twostroke.engine.text.chat_template import ChatTemplateKwargsError
from twostroke.engine.text.detokenizer import DetokenizerError
from twostroke.engine.text.gguf_vocab import UnknownPreTokenizer
from twostroke.engine.text.tokenizer import ChatTemplateError, TokenizerLoadError
from twostroke.states.constraints import AnyJsonObject, Choice, Grammar, JsonSchema, Regex
from twostroke.states.params import SamplingParams
from twostroke.states.request import FinishReason

__all__ = [
    "LLM",
    "AnyJsonObject",
    "BlockTypeUnsupported",
    "ChatTemplateError",
    "ChatTemplateKwargsError",
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
    "QuantizerUnavailable",
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
    "SyntheticCacheUnavailable",
    "TokenizerLoadError",
    "UnknownPreTokenizer",
    "UnknownShape",
    "UnmarkedCache",
    "Usage",
    "WeightError",
]
