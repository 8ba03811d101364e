"""Batched solver for ``a R^4 + b R^3 + c R^2 + d R + e = 0`` (C++ extension).

Use :func:`normfast.solve_quartic`, which validates and converts its input;
these functions take float64 ``[N, 5]`` arrays only.
"""

import numpy as np
import numpy.typing as npt

touch_factor: float

def solve(coeffs: npt.NDArray[np.float64], threads: int = 0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int8]]:
    """Largest positive real root per row (NaN where none) and the number of distinct positive roots.

    ``threads <= 0`` uses OpenMP's default team size. Raises ValueError unless
    ``coeffs`` has shape ``[N, 5]``.
    """

def default_threads() -> int:
    """OpenMP's default team size (1 when built without OpenMP)."""
