import pytest

from tensorpar.testing import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Rank pools live for the whole session; stop them when it ends."""
    yield
    shutdown_pools()
