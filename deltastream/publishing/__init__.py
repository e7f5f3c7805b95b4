"""From a delta to the topic: ``select_changed`` picks the rows to send, ``DeltaPublisher``
sends them as wire-format messages, and topic admin creates the topic."""
