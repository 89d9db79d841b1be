import os

import pytest

from tensorpar.testing import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Rank pools live for the whole session; stop them when it ends."""
    yield
    shutdown_pools()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: breadth beyond the fast tier (run with "
                            "TENSORPAR_SLOW=1 or -m slow)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TENSORPAR_SLOW") or config.getoption("-m") == "slow":
        return
    skip = pytest.mark.skip(reason="slow tier: set TENSORPAR_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
