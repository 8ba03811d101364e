"""Plain reference implementations that the fast paths are tested against.

Two parts, kept apart:

1. the equilibrium quartic: a pure-numpy batched solver (companion-matrix
   eigenvalues + Newton polishing) that ``normfast._quartic`` must match;
2. the probe statistics: plain-torch references for every Triton kernel and a
   float64 brute force that materializes every displacement ``t_i^B``.
"""
from __future__ import annotations

import numpy as np
import torch

# ============================================================================
# 1. Equilibrium quartic
# ============================================================================


# ============================================================================
# 2. Probe statistics (kernel references, float64 brute force, tolerances)
# ============================================================================
