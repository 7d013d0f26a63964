"""Every test under tests/unit is a single-process CPU test: marked ``unit``."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/unit/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.unit)
