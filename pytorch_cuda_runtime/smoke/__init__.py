"""Smoke suite: `python -m pytorch_cuda_runtime.smoke` (see cli.py)."""
