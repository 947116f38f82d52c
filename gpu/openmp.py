"""OpenMP's wait policy, chosen before torch loads its OpenMP runtime.

torch's intra-op threads are a GNU OpenMP team. By default a team thread that reaches a
barrier first *spins* for a while (``GOMP_SPINCOUNT``, 300 000 polls) before it sleeps. That
is right on a machine the team has to itself, and ruinous on one it shares: when a team
thread is descheduled (another process, or the engine's own event loop thread, wants the
core), its partners burn their time slices spinning for it, and every one of the hundreds of
barriers in a step pays. Measured on 2 cores shared with other jobs (load average 6-8,
SmolLM2-135M bf16, a batch-32 decode step): 2 threads took 692-3405 ms with the default
policy against 220 ms on 1 thread; with ``OMP_WAIT_POLICY=PASSIVE`` 2 threads took
178-480 ms.

Sleeping has its price on a machine the team has to itself: a sleeping thread is woken
through the kernel at each of the step's parallel regions. Measured 2026-12-01 (AVX2 EPYC,
2 cores, SmolLM2 float32 with packed weights, decode steps of 1 and 32 requests, one process
per policy, four rounds alternated, median step of each): on an otherwise idle machine
passive waits took 93 and 298 ms, ``GOMP_SPINCOUNT=3000`` 77 and 263, ``30000`` 77 and 251,
``OMP_WAIT_POLICY=ACTIVE`` 79 and 247 (spinning is 15-20 % faster); with one other process
busy on one core, passive took 106-132 and 396-416 ms, ``3000`` 157-179 and 435-506,
``30000`` 342-536 and 1217-1294 (spinning is 1.2-4x slower).

The engine resolves the dilemma with its thread count, not its waits: unless told a fixed
``torch_threads``, it drops to one thread while another process wants a core
(:mod:`twostroke.gpu.cores`), and one thread has no partner to wait for. Measured inside the
engine (docs/performance.md, 2026-12-02; 32 requests, output tok/s): with one other core busy,
spinning ran a governed engine at 39.1 against 37.4-41.3 passive, where a fixed team of two
fell to 14.3; on a quiet machine spinning gained 7-12 % (61.7 and 70.8 against 57.8 and
63.0). So twostroke sets ``GOMP_SPINCOUNT=30000``: bounded spinning (a tenth of GNU OpenMP's
own default; as fast as ``ACTIVE``'s endless spinning above), then sleep.

What still spins on a shared machine is torch work on several threads that no governor
watches: an engine with a fixed ``torch_threads`` above one, or an application's own torch
(which would spin ten times longer without twostroke). For those, export
``OMP_WAIT_POLICY=PASSIVE`` before starting Python; the coordinator gives its process
replicas, whose thread counts are fixed shares of the cores, passive waits itself
(:func:`replica_wait_policy`).

Spinning also stops on its own where the process holds more OpenMP threads than cores: GNU
OpenMP then spins a hundred polls at most before it sleeps. Every thread that ran a parallel
region keeps its team's workers for its whole life, so torch work on two threads outside the
engine's forward thread (the caller's own, or a kernel's check at load) leaves a second
team beside the engine's, and every barrier of a step sleeps and wakes through the kernel.
Measured 2026-12-05 (Intel Xeon, 2 cores, SmolLM2's GGUF blocks, one stream, 200 tokens at
a history of 300, one process each, alternated): 9-14 ms a token, against 17-35 ms with one
``torch.mm`` of two threads run first on the main thread. So the engine loads its model on
the forward thread, and the model loader checks its kernels on one thread: the caller's
thread is left without a team (a test checks it). An application's own torch work on
several threads beside an engine brings the second team back; run it on a thread that ends
(its team ends with it), or on one torch thread.

The runtime reads the policy once, when it is loaded (``import torch``), so
:func:`prefer_bounded_spin` runs when ``twostroke.gpu`` is imported, before it imports
torch. It never overrides a policy the user chose, and does nothing if torch was imported
first.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "SET_AT_IMPORT",
    "SPIN_COUNT",
    "WAIT_POLICY_VARIABLES",
    "prefer_bounded_spin",
    "replica_wait_policy",
    "wait_policy",
]

#: The environment variables that decide how OpenMP threads wait; any one set by the user
#: is their choice, and is left alone.
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


#: The polls a team thread spins at a barrier before it sleeps, unless the user chose.
SPIN_COUNT = "30000"


def prefer_bounded_spin() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` if nobody chose a policy and torch is not
    loaded yet.

    Returns:
        Whether this call set it.
    """
    if "torch" in sys.modules or any(name in os.environ for name in WAIT_POLICY_VARIABLES):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


#: Whether importing ``twostroke.gpu`` set the policy: its ``__init__`` imports this module
#: first, before anything in the package imports torch.
SET_AT_IMPORT = prefer_bounded_spin()

#: The wait-policy variables as they were when ``twostroke.gpu`` was imported: what torch's
#: OpenMP runtime read, unless torch was loaded before (then it read the same, or older).
_AT_IMPORT = {name: os.environ.get(name) for name in WAIT_POLICY_VARIABLES}


def wait_policy() -> str:
    """How torch's OpenMP threads wait at a barrier, in words (benchmarks report it beside
    their figures: it moves a step by 15-20 %, see the module)."""
    chosen = " ".join(f"{name}={value}" for name, value in _AT_IMPORT.items() if value is not None)
    if not chosen:
        return "GNU OpenMP's default (spin 300,000 polls, then sleep)"
    return f"{chosen} ({'set by twostroke' if SET_AT_IMPORT else 'chosen by the user'})"


def replica_wait_policy(environ: dict[str, str]) -> dict[str, str]:
    """The wait policy for a child process whose torch thread count is fixed, in place.

    A fixed team of several threads spins for partners another process keeps from their
    cores (the module), so such a child gets ``OMP_WAIT_POLICY=PASSIVE`` instead of the
    spinning twostroke chose for this process, unless the user chose a policy: theirs is
    left as it is.

    Args:
        environ: The child's environment, inherited from this process's.

    Returns:
        ``environ``, changed.
    """
    chosen = {name: environ.get(name) for name in WAIT_POLICY_VARIABLES}
    set_here = SET_AT_IMPORT and chosen == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": SPIN_COUNT}
    if set_here or not any(value is not None for value in chosen.values()):
        environ.pop("GOMP_SPINCOUNT", None)
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return environ
