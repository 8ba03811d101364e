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

from normfast.data.datasets import missing_system_data  # noqa: E402

#: NORMFAST_REQUIRE_DATA=1 (set by .ci/run): a test whose Debian data is absent fails instead of skipping
REQUIRE_DATA = os.environ.get("NORMFAST_REQUIRE_DATA", "") not in ("", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs_data("wordnet" | "fashion-mnist")``: skip with a one-line reason when the
    Debian data is not installed (fail instead under NORMFAST_REQUIRE_DATA=1), before any fixture runs."""
    for mark in item.iter_markers("needs_data"):
        for name in mark.args:
            reason = missing_system_data(name)
            if reason is None:
                continue
            if REQUIRE_DATA:
                pytest.fail(f"NORMFAST_REQUIRE_DATA=1 but {reason}", pytrace=False)
            pytest.skip(reason)


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
