"""The law: equilibrium coefficients, the batched quartic solver's bindings, float64 references.

Nothing here imports another layer of normfast.
"""
