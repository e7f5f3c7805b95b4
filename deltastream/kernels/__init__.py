"""Triton kernels for the trainer's CUDA hot paths, and the rule for when they run
(:mod:`deltastream.kernels.runtime`)."""
