"""What the kernel tests share: the device they run on, the fp32 tolerance, random inputs."""

import pytest
import torch

pytest.importorskip("triton")

from normfast.core.reference import allowed_error  # noqa: E402
from normfast.kernels import interpreted  # noqa: E402

ON_GPU = torch.cuda.is_available() and not interpreted()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = allowed_error(torch.float32)
#: the CUDA-only cases (low precision, larger shapes): run where a GPU is present and the interpreter is off
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (TRITON_INTERPRET=0)")


def skip_without_kernels() -> None:
    """A module-level skip where the kernels can run nowhere (no GPU, the interpreter off)."""
    if not ON_GPU and not interpreted():
        pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)


def worst(errors):
    return max(v for k, v in errors.items() if not k.startswith("sign_stability"))


def sign_ok(errors):
    return all(v <= (1 if "batches" in k else 0.01) for k, v in errors.items() if k.startswith("sign_stability"))


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)
