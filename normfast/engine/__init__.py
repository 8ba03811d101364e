"""The estimator: update directions, transmission (jvp and closed-form head), accumulators,
the array backend (:mod:`normfast.ops`) and the probe loop (:mod:`normfast.engine.probe`).

Imports :mod:`normfast.core`, :mod:`normfast.data`, :mod:`normfast.encoders` and ``normfast.kernels``;
never :mod:`normfast.apps`.
"""
