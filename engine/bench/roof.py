"""The roof: how fast this machine could run the workload, and each system's fraction of it.

Three parts. :func:`~twostroke.engine.bench.probe.measure_machine` measures the machine's two
rates in a few seconds, each until it settles (:mod:`~twostroke.engine.bench.probe`): the
memory bandwidth and the matmul throughput in the bench's dtype on its threads.
:mod:`~twostroke.engine.bench.cost` counts what each step of the model must move and compute.
:func:`workload_roof` adds up, over the steps of a schedule, each step's floor,
``max(bytes / bandwidth, FLOPs / FLOPS)`` (the roofline): the time no implementation of that
schedule can beat on this machine. The schedule is the one the depth-2 engine ran when the
run recorded it (:func:`recorded_schedule`), else the one the engine's own scheduler plans for
the workload, run without a model (:func:`simulated_plans`).

The roof throughput is the workload's output tokens over that floor; a system's fraction of
the roof is its output throughput over the roof's. Each system's roof costs the weights that
system reads (:func:`system_weights`: twostroke's plan, a GGUF peer's file as stored, vLLM's
and transformers' dense weights in the bench's dtype); a system whose weights are not known
gets the roof of the smallest weights in the run, a lower floor and still a bound. A probe
that read low makes a roof that a run can pass: the report marks such a fraction, never
prints it as one.

The probe's names (:class:`MachineRoof`, :class:`Probe`, :func:`measure_machine`,
:func:`machine_speed`, :func:`settle`, :func:`last_level_cache_bytes`) are re-exported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs

from twostroke.engine.bench.cost import ModelCost
from twostroke.engine.bench.model import ModelSpec
from twostroke.engine.bench.probe import (
    MachineRoof,
    Probe,
    last_level_cache_bytes,
    machine_speed,
    measure_machine,
    settle,
)
from twostroke.engine.bench.workload import Workload
from twostroke.states.params import SamplingParams
from twostroke.states.plan import RunnerOutput, StepPlan
from twostroke.states.request import Request
from twostroke.states.scheduler import Scheduler, SchedulerConfig, SchedulingPolicy
from twostroke.states.validators import int_at_least, number_in

if TYPE_CHECKING:
    from twostroke.engine.models.plan import RunPlan

__all__ = [
    "MachineRoof",
    "Probe",
    "SystemWeights",
    "WorkloadRoof",
    "last_level_cache_bytes",
    "machine_speed",
    "measure_machine",
    "prepare_roof",
    "recorded_schedule",
    "roof_of_run",
    "settle",
    "simulated_plans",
    "system_weights",
    "workload_roof",
]

_POSITIVE = number_in(0, low_open=True)


def _by_name(roofs: Mapping[str, WorkloadRoof]) -> dict[str, WorkloadRoof]:
    return dict(roofs)


@attrs.frozen(kw_only=True)
class WorkloadRoof:
    """The floor of a workload's schedule on a machine, and the throughput it allows.

    Attributes:
        machine: The rates.
        schedule: Which steps were costed (the recorded run's, or the simulated schedule).
        steps: How many.
        floor_seconds: The sum of the steps' floors.
        memory_bound_steps: Steps whose floor is their bytes (the rest: their FLOPs).
        bytes: Bytes over all steps.
        flops: FLOPs over all steps.
        output_tokens: The workload's output tokens.
        weights: Which weights the steps read, for the report (``""``: not said).
        systems: Each system's own roof, by name, where its weights are known
            (:func:`roof_of_run`); this roof is then the smallest weights', the others'.
    """

    machine: MachineRoof
    schedule: str
    steps: int = attrs.field(validator=int_at_least(1))
    floor_seconds: float = attrs.field(validator=_POSITIVE)
    memory_bound_steps: int = attrs.field(validator=int_at_least(0))
    bytes: int = attrs.field(validator=int_at_least(0))
    flops: int = attrs.field(validator=int_at_least(0))
    output_tokens: int = attrs.field(validator=int_at_least(1))
    weights: str = ""
    # (A dict is no hash: a roof hashes by its own figures.)
    systems: Mapping[str, WorkloadRoof] = attrs.field(factory=dict, converter=_by_name, hash=False)

    @property
    def output_throughput(self) -> float:
        """Output tokens per second at the floor: the roof."""
        return self.output_tokens / self.floor_seconds

    def of_system(self, name: str | None) -> WorkloadRoof:
        """The roof of the system ``name``: its own where its weights are known, else this."""
        return self if name is None else self.systems.get(name, self)

    def fraction(self, output_throughput: float, system: str | None = None) -> float:
        """A system's output throughput as a fraction of its roof's (:meth:`of_system`)."""
        return output_throughput / self.of_system(system).output_throughput

    def exceeded(self, output_throughput: float, system: str | None = None) -> bool:
        """Whether a system ran faster than its roof: no fraction, but a roof too low (a
        probe that read low, or work the cost model does not see)."""
        return self.fraction(output_throughput, system) > 1

    def percent(self, output_throughput: float, system: str | None = None) -> str:
        """The report's cell: the percentage of the roof, or ``">100 (roof too low)"``."""
        if self.exceeded(output_throughput, system):
            return ">100 (roof too low)"
        return f"{100 * self.fraction(output_throughput, system):.0f}"

    def summary(self) -> str:
        """The report's lines: rates, floor, roof throughput, the schedule, and each group of
        systems whose weights have a roof of their own."""
        bound = round(100 * self.memory_bound_steps / self.steps)
        line = (
            f"roof: {self.machine.summary()}; floor {self.floor_seconds:.2f} s over "
            f"{self.steps} steps ({bound} % memory-bound) of {self.schedule} → "
            f"{self.output_throughput:.1f} output tok/s"
        )
        if self.weights:
            line += f" reading {self.weights}"
        groups: dict[tuple[str, float], tuple[WorkloadRoof, list[str]]] = {}
        for name, roof in self.systems.items():
            groups.setdefault((roof.weights, roof.floor_seconds), (roof, []))[1].append(name)
        lines = [line]
        for roof, names in groups.values():
            lines.append(
                f"roof of {', '.join(names)}: floor {roof.floor_seconds:.2f} s → "
                f"{roof.output_throughput:.1f} output tok/s reading {roof.weights}"
            )
        if self.systems:
            lines.append("(a system not named above: the roof of the run's smallest weights)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, the roof throughput and each system's own roof included."""
        return {
            **attrs.asdict(self, recurse=False),
            "machine": self.machine.to_json(),
            "output_throughput": self.output_throughput,
            "systems": {name: roof.to_json() for name, roof in self.systems.items()},
        }


def workload_roof(
    machine: MachineRoof,
    cost: ModelCost,
    plans: Iterable[StepPlan],
    *,
    schedule: str,
    output_tokens: int,
    weights: str = "",
) -> WorkloadRoof:
    """Cost every step of ``plans`` and add up their floors on ``machine``.

    Args:
        machine: The rates.
        cost: The model's costs.
        plans: The schedule, one plan per step.
        schedule: What the schedule is, for the report.
        output_tokens: The workload's output tokens (the roof throughput's numerator).
        weights: Which weights ``cost`` reads, for the report.

    Raises:
        ValueError: ``plans`` is empty, or a plan has no rows.
    """
    floor, steps, memory_bound, total_bytes, total_flops = 0.0, 0, 0, 0, 0
    for plan in plans:
        step = cost.plan(plan)
        seconds = machine.step_seconds(step.bytes, step.flops)
        floor += seconds
        steps += 1
        memory_bound += step.bytes / machine.bandwidth >= step.flops / machine.flops
        total_bytes += step.bytes
        total_flops += step.flops
    if not steps:
        raise ValueError("a workload's roof needs at least one step, got none")
    return WorkloadRoof(
        machine=machine,
        schedule=schedule,
        steps=steps,
        floor_seconds=floor,
        memory_bound_steps=memory_bound,
        bytes=total_bytes,
        flops=total_flops,
        output_tokens=output_tokens,
        weights=weights,
    )


def simulated_plans(workload: Workload, policy: SchedulingPolicy | None = None) -> list[StepPlan]:
    """The steps twostroke's scheduler plans for ``workload``, run without a model.

    Every request arrives at once (a serving workload's arrival times are not simulated),
    the pipeline is serial (no lookahead token is wasted) and the KV pool holds every request
    at once (nothing is preempted): the schedule a floor should be taken over. Each sampled
    token is id 0 and EOS is ignored, as the bench's requests run to ``max_tokens``.

    Args:
        workload: The requests.
        policy: The batching limits (``max_num_seqs``, ``max_num_batched_tokens``, block size,
            prefix caching); the engine's defaults when ``None``.

    Returns:
        One plan per step, in order.
    """
    policy = policy or SchedulingPolicy()
    block = policy.block_size
    lengths = [len(r.prompt_token_ids) + r.max_tokens for r in workload.requests]
    config = SchedulerConfig.sized(
        attrs.evolve(policy, pipeline_depth=1),
        num_blocks=sum(-(-length // block) for length in lengths) + 1,
        max_model_len=max(2, *lengths),
    )
    scheduler = Scheduler(config, clock=lambda: 0.0)
    for index, request in enumerate(workload.requests):
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        scheduler.add_request(Request(index, request.prompt_token_ids, params, 0.0))
    plans: list[StepPlan] = []
    while not scheduler.is_idle():
        plan = scheduler.schedule()
        # A serial scheduler with every request fitting the pool always has work to plan.
        assert plan is not None, "the scheduler planned nothing with requests left"
        plans.append(plan)
        sampled = {entry.request_id: 0 for entry in plan.requests if entry.sample}
        scheduler.apply(RunnerOutput(step_id=plan.step_id, sampled=sampled))
    return plans


def recorded_schedule(drivers: Iterable[object], name: str) -> list[StepPlan] | None:
    """The step plans the system ``name`` ran, if it is among ``drivers`` and recorded them.

    twostroke's depth-2 driver keeps a ``recording`` with its ``plans`` after a run (the
    bare forward loop replays them); any other driver, or one that did not run, gives
    ``None``.
    """
    for driver in drivers:
        if getattr(driver, "name", None) != name:
            continue
        plans = getattr(getattr(driver, "recording", None), "plans", None)
        if plans:
            return list(plans)
    return None


# ---------------------------------------------------------------------------------------------
# The bench's use: measure before the systems run, cost the schedule after.


def prepare_roof(
    model: ModelSpec, *, measure: Callable[..., MachineRoof] = measure_machine
) -> tuple[MachineRoof, ModelCost]:
    """Read the model's shape and measure the machine, at the bench's dtype and threads.

    The weights cost what the engine's plan of the run reads
    (:func:`~twostroke.engine.models.plan.resolve_run`, the engine's defaults at the bench's
    dtype; :func:`plan_cost`).

    Args:
        model: The bench's model: its source gives the shape, its dtype and threads the
            measurement's.
        measure: Called with ``dtype`` and ``threads``; :func:`measure_machine` unless a
            test gives its own figures.

    Raises:
        ModelLoadError: the model's configuration cannot be read (before anything is
            measured).
    """
    import torch

    from twostroke.engine.config import DtypeOption, EngineConfig
    from twostroke.engine.models.plan import resolve_run
    from twostroke.engine.models.source import read_source
    from twostroke.engine.runners.loading import default_torch_threads

    # The engine's own plan for the run's options (weights, activations, KV cache): the
    # roof costs what the engine reads.
    config = EngineConfig(dtype=cast(DtypeOption, model.dtype) if model.exact else "auto")
    plan = resolve_run(config, read_source(model.source), torch.device("cpu"))
    cost = plan_cost(plan, model.source)
    dtype = str(plan.dtype).removeprefix("torch.")
    # The torch threads twostroke's systems run on, given the bench's cores.
    return measure(dtype=dtype, threads=default_torch_threads(model.threads)), cost


def plan_cost(plan: RunPlan, source: Path) -> ModelCost:
    """The costs of a step of twostroke's run ``plan`` of the model at ``source``.

    A GGUF file whose blocks the plan computes as stored costs its stored bytes
    (:func:`~twostroke.engine.models.loading.stored_bytes`); projections quantized into
    blocks at load cost those blocks; another model its projections in the precision the plan
    holds them in and the rest in its dtype; the KV cache its positions in the plan's cache
    dtype.

    Raises:
        ModelLoadError: a GGUF file's blocks that cannot be read.
    """
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.plan import BLOCK_ACTIVATIONS

    as_stored = plan.weights in BLOCK_ACTIVATIONS
    if plan.requantize is not None:
        quantization = plan.weights
    else:
        quantization = None if as_stored else plan.kernels.projection.quantization
    return ModelCost.of(
        plan.config,
        dtype=str(plan.dtype).removeprefix("torch."),
        quantization=quantization,
        stored=stored_bytes(source) if as_stored else None,
        kv_cache_dtype=str(plan.cache_dtype).removeprefix("torch."),
    )


@attrs.frozen
class SystemWeights:
    """The weights one system reads a step, as its roof costs them.

    Attributes:
        description: What they are, for the roof's line (``"bfloat16 weights"``).
        cost: The step's costs with them.
    """

    description: str
    cost: ModelCost


def system_weights(drivers: Iterable[object], model: ModelSpec) -> dict[str, SystemWeights]:
    """The weights each of ``drivers`` reads a step of ``model``, by system name, where known.

    * twostroke's systems (a driver with ``plan(model, device)``): the plan of the run as
      the engine makes it from the system's options (:func:`plan_cost`);
    * llama.cpp, llama-server, OpenVINO GenAI and mistral.rs on a GGUF file: the file's
      stored bytes, on float32 activations, the KV cache in float16 (llama.cpp's and
      mistral.rs's default; OpenVINO's CPU default: 8 bits);
    * vLLM and transformers: dense weights, activations and KV cache in the bench's dtype
      (vLLM reads the bench's Hugging Face folder in it; transformers dequantizes a GGUF
      file into it).

    Any other system (an HTTP endpoint), or one whose plan cannot be made here, is left
    out: its roof is the run's smallest weights' (:func:`roof_of_run`).

    Raises:
        ModelLoadError: the model's configuration cannot be read.
    """
    import torch

    from twostroke.engine.bench.llamacpp_peer import GGUFPeer
    from twostroke.engine.bench.llamaserver_peer import LlamaServerDriver
    from twostroke.engine.bench.openvino_peer import OpenVinoDriver
    from twostroke.engine.bench.peers import HFContinuousDriver, HFStaticDriver
    from twostroke.engine.bench.vllm_peer import VLLMDriver
    from twostroke.engine.errors import EngineError
    from twostroke.engine.models.loading import stored_bytes
    from twostroke.engine.models.source import read_config

    config = read_config(model.source)
    stored: dict[str, int] | None = None
    known: dict[str, SystemWeights] = {}
    for driver in drivers:
        name = str(getattr(driver, "name", ""))
        if isinstance(driver, GGUFPeer | LlamaServerDriver):
            if not model.is_gguf:
                continue  # it does not run
            stored = stored if stored is not None else stored_bytes(model.source)
            cache = "uint8" if isinstance(driver, OpenVinoDriver) else "float16"
            cost = ModelCost.of(config, stored=stored, kv_cache_dtype=cache)
            known[name] = SystemWeights(f"the GGUF file as stored, {cache} KV", cost)
        elif isinstance(driver, HFStaticDriver | HFContinuousDriver | VLLMDriver):
            cost = ModelCost.of(config, dtype=model.dtype)
            known[name] = SystemWeights(f"dense {model.dtype} weights", cost)
        elif callable(plan := getattr(driver, "plan", None)):
            try:
                with warnings.catch_warnings():
                    # (A form that does not run here warns when the system loads, not here.)
                    warnings.simplefilter("ignore")
                    run = plan(model, torch.device("cpu"))
                    cost = plan_cost(run, model.source)
            except (EngineError, ValueError):
                # A plan that cannot be made here (blocks of a folder, a kernel that does
                # not build): the system fails its own run the same way; its weights are
                # not known, and it takes the smallest weights' roof.
                continue
            known[name] = SystemWeights(
                f"twostroke's plan: {run.weights or run.dtype} weights, "
                f"{str(run.dtype).removeprefix('torch.')} activations",
                cost,
            )
    return known


def roof_of_run(
    machine: MachineRoof,
    cost: ModelCost,
    workload: Workload,
    *,
    drivers: Iterable[object] = (),
    recorded_by: str = "twostroke-depth2",
    policy: SchedulingPolicy | None = None,
    weights: Mapping[str, SystemWeights] | None = None,
) -> WorkloadRoof:
    """The workload's roof over the steps ``recorded_by`` ran, else its simulated schedule.

    Args:
        machine: The rates.
        cost: The model's costs (the roof's when ``weights`` names none).
        workload: What the systems ran.
        drivers: The run's systems; one named ``recorded_by`` may hold its step plans.
        recorded_by: The system whose schedule is preferred.
        policy: The batching limits of the simulated schedule.
        weights: Each system's weights (:func:`system_weights`): each gets a roof of its
            own, and the roof returned is the one of the smallest weights among them (a
            lower floor, still a bound, for a system whose weights are not known).
    """
    output_tokens = sum(request.max_tokens for request in workload.requests)
    plans = recorded_schedule(drivers, recorded_by)
    if plans is not None:
        schedule = f"the schedule {recorded_by} ran"
    else:
        plans = simulated_plans(workload, policy)
        schedule = f"the scheduler's plan without a model (no {recorded_by} run to replay"
        schedule += ")" if workload.is_offline else "; every request at t = 0)"
    if not weights:
        return workload_roof(machine, cost, plans, schedule=schedule, output_tokens=output_tokens)
    roofs: dict[SystemWeights, WorkloadRoof] = {}
    for system in weights.values():
        if system not in roofs:
            roofs[system] = workload_roof(
                machine,
                system.cost,
                plans,
                schedule=schedule,
                output_tokens=output_tokens,
                weights=system.description,
            )
    # The lowest floor: the smallest weights' (the FLOPs are every system's).
    smallest = min(roofs.values(), key=lambda roof: roof.floor_seconds)
    return attrs.evolve(
        smallest,
        weights=f"the run's smallest weights ({smallest.weights})",
        systems={name: roofs[system] for name, system in weights.items()},
    )
