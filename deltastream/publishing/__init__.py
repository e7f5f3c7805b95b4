"""From a delta to the topic: ``select_changed`` picks the rows to send (or a
``BudgetPublisher`` spends a byte budget on the largest serving errors; ``RoundPublisher``
runs ``publish_delta``'s rounds off the training thread), ``DeltaPublisher``
sends them as wire-format messages, and topic admin creates the topic."""
