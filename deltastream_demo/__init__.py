"""The deltastream demo: synthetic click stream, a small CTR model, trainer and predictor
processes, scoring, report and plots. Sits above both ``deltastream`` and ``consumers``;
neither imports it. ``deltastream demo`` loads it lazily."""
