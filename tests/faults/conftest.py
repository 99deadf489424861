"""The fault suite (issue 18): real stacks that lose, freeze and restart processes under load.

Every test here is marked `faults` (as is the odd fault test elsewhere, marked by hand):
`make test-faults` runs them (the suite is meant to be run
several times in a row, and takes minutes of its own), `make test` leaves them out to stay within
its time budget.
"""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/faults/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.faults)
