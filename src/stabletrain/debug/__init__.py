"""Debugging tools: gradient norm, underflow/overflow tracing, NaN capture, diagnosis, trends.

Each tool lives in its own module and works in a plain PyTorch loop as well as in the trainer.
"""
