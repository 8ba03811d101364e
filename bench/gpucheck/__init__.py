"""The stages of bench/gpu_check.py, one module per responsibility (see that script)."""
