"""Fixtures of the fault tests of the probe command: a words file, and a guard that fails a test whose
refusal came after the run started computing."""

from pathlib import Path

import pytest
import torch


@pytest.fixture
def words(tmp_path) -> Path:
    path = tmp_path / "words.txt"
    path.write_text("apple\nriver\nthe\ndemocracy\nblue\nquantum\nstone\nhouse\nmusic\ngreen\n")
    return path


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if any virtual batch is differentiated (the refusal must come first)."""

    def grad(*a, **k):
        raise AssertionError("the run started computing before refusing its arguments")

    monkeypatch.setattr(torch.autograd, "grad", grad)
