import os

import pytest
import tolerance_audit
import torch
from tolerance_audit import pytest_assertion_pass  # noqa: F401  (records figures when POET_TOLERANCE_AUDIT is set)

# The tests use tiny models: one thread avoids OpenMP spin-waits, which on 2 cores cost more than they give.
# POET_TEST_THREADS runs the suite with more, to check that no tolerance depends on the reduction order.
torch.set_num_threads(int(os.environ.get("POET_TEST_THREADS", "1")))

_current_test = {"id": None}
if tolerance_audit.audit_file():
    tolerance_audit.install(lambda: _current_test["id"])


@pytest.fixture(autouse=True)
def _seed(request):
    _current_test["id"] = request.node.nodeid
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """The tests on the pretrained testbed run last: CI builds the testbed beside the rest of the suite
    (`.ci/run`), and these wait for it."""
    items.sort(key=lambda item: item.get_closest_marker("testbed") is not None)
