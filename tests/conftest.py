import pytest
import torch

# The tests use tiny models: one thread avoids OpenMP spin-waits, which on 2 cores cost more than they give,
# and keeps reductions in one fixed order.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
