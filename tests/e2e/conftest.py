"""End-to-end tests: each starts the commands of the README and docs/ itself (``mbx demo`` launches its own 2 ranks).

Run with plain pytest (``make e2e``), not under torchrun. Marked ``e2e``.
"""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
