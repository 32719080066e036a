"""Shared test settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The test models are tiny: one intra-op thread is several times faster than two on a
    2-core machine (thread start-up dominates such small matrices)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
