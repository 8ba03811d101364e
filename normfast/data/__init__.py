"""Inputs and outputs: pair sources, offline datasets, BEIR collections, Parquet I/O and its schema.

Imports :mod:`normfast.core` only.
"""
