"""Predictor persistence: atomic multi-table snapshots and incremental checkpoints."""
