"""Root conftest of the mutation staging tree (scripts/mutate.sh copies it there, nowhere else).

mutmut maps each function to the tests that call it, from the trampoline hits it records
while each test runs, and runs only those tests against that function's mutants. Functions
called while the modules are imported (the attrs validator factories: ``int_at_least(1)``
runs when ``SchedulerConfig`` is defined) are hit during collection, before any test, so
mutmut credits them all to whichever test happens to run first. Their mutants change every
validator built at import, so every test may see them: credit the import-time hits to every
test. (The fork server imports only third-party modules, mutmut_preload.txt, so each mutant's
process imports ``twostroke.states`` afresh and its import-time calls take the mutant.)
"""

from __future__ import annotations

import os
from typing import Any

import pytest

_import_hits: set[str] = set()


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        from mutmut import state

        _import_hits.update(state()._stats)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> None:
    if _import_hits:
        from mutmut import state

        state()._stats.update(_import_hits)
