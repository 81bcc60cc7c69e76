import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_determinism():
    torch.manual_seed(0)
    yield
