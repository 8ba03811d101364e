"""Test configuration shared by every test module.

Triton kernels run through the interpreter on machines without a GPU. The
variable must be set before triton is first imported, hence here, at the very
top of the first module pytest loads. To compile for real on a GPU run
``TRITON_INTERPRET=0 python -m pytest``.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded numpy generator per test (tests must not share state)."""
    return np.random.default_rng(12345)


@pytest.fixture
def gen() -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(12345)
    return g


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for modules of tiny models: thread hand-off dominates their
    matmuls on small shared machines (restored afterwards). Use with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
