"""Delta tracking on the trainer: ``DeltaTracker`` records lookups into a ``DeltaStore`` with
one cursor per consumer."""
