"""Explain: the tools that say where, why and what to change (gradient norm, trends,
underflow/overflow tracing, NaN capture, replay, op tracing, diagnose).

Each tool lives in its own module or package and works in a plain PyTorch loop as well as in
the trainer. What stops and heals a run is in :mod:`stabletrain.safety`.
"""
