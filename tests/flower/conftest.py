"""The ``timing`` tests (a stopwatch on real processes) run only when asked for (``-m timing``):
their numbers move with the machine's load, so ``make test-flower`` and CI leave them out."""

import pytest


def pytest_collection_modifyitems(config, items):
    if "timing" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="a stopwatch on real processes: run with -m timing")
    for item in items:
        if item.get_closest_marker("timing"):
            item.add_marker(skip)
