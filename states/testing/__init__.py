"""Hypothesis tools for the scheduling core: strategies and three state machines.

This is a test-support module: it imports hypothesis, which comes with the ``test`` extra
(``pip install 'twostroke[test]'``); nothing else in :mod:`twostroke.states` imports it.

* Strategies: :func:`sampling_params`, :func:`request_specs`, :func:`requests`,
  :func:`workloads`, :func:`scheduler_configs` and :func:`windowed_pools` draw valid values; pass a
  :class:`~twostroke.states.scheduler.SchedulerConfig` to get only requests it can serve.
* Machines (``RuleBasedStateMachine``, each against a plain reference model):
  :class:`RequestMachine` (the lifecycle table and the token counts),
  :class:`BlockPoolMachine` (a dict of reference counts), :class:`PrefixCacheMachine`
  (a dict from token prefixes to blocks) and :class:`SchedulerMachine`
  (a :class:`~twostroke.states.testing.harness.SimulatedEngine`, whose reference is the output of
  the same "model" without any scheduler). Subclass one and set its class attributes, or
  call :meth:`SchedulerMachine.for_config`, to test your own configuration; run it with
  ``TestMine = MyMachine.TestCase``.
* :func:`waiting_ids` and :func:`running_ids`: a scheduler's queues, read from its records.
* Constraints: :class:`ReferenceMatcher` (a plain
  :class:`~twostroke.states.constraints.Matcher` for choices and regexes over a vocabulary of
  token texts) and the strategies :func:`regexes`, :func:`choices` and
  :func:`token_vocabularies` that draw what it can follow.
* Re-exported from the pure modules: :func:`drive`, :class:`SimulatedKV`,
  :func:`reference_output` and the rest, so one import gives the whole toolkit.
"""

from twostroke.states.simulation import (
    NextToken,
    SimulatedKV,
    SimulationError,
    reference_output,
    toy_next_token,
)
from twostroke.states.testing.constraints import ReferenceMatcher, parse_regex, regex_matches
from twostroke.states.testing.harness import DriveResult, SimulatedEngine, drive, step_bound
from twostroke.states.testing.machines import (
    BlockPoolMachine,
    DraftingSchedulerMachine,
    RequestMachine,
    SchedulerMachine,
)
from twostroke.states.testing.prefix import PrefixCacheMachine, PrefixModel
from twostroke.states.testing.queues import running_ids, waiting_ids
from twostroke.states.testing.strategies import (
    CONSTRAINT_ALPHABET,
    EOS_TEXT,
    choices,
    regexes,
    request_specs,
    requests,
    sampling_params,
    scheduler_configs,
    token_vocabularies,
    windowed_pools,
    workloads,
)
from twostroke.states.testing.workload import RequestSpec, Workload

__all__ = [
    "CONSTRAINT_ALPHABET",
    "EOS_TEXT",
    "BlockPoolMachine",
    "DraftingSchedulerMachine",
    "DriveResult",
    "NextToken",
    "PrefixCacheMachine",
    "PrefixModel",
    "ReferenceMatcher",
    "RequestMachine",
    "RequestSpec",
    "SchedulerMachine",
    "SimulatedEngine",
    "SimulatedKV",
    "SimulationError",
    "Workload",
    "choices",
    "drive",
    "parse_regex",
    "reference_output",
    "regex_matches",
    "regexes",
    "request_specs",
    "requests",
    "running_ids",
    "sampling_params",
    "scheduler_configs",
    "step_bound",
    "token_vocabularies",
    "toy_next_token",
    "waiting_ids",
    "windowed_pools",
    "workloads",
]
