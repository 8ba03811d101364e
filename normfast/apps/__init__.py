"""Thin drivers over the engine: the commands (probe, solve, demo, report, validate, retrieval, bench)
and the experiments they run.
"""
