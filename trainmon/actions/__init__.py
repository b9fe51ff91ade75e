"""Actions on anomalies: a targeted msprobe-style dump and free-benchmark perturbation checks.

Import the submodules directly (``trainmon.actions.dump``, ``trainmon.actions.free_benchmark``):
they need torch, while :mod:`trainmon.actions.naming` is framework-free.
"""
