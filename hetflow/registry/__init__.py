"""MLflow, as the register task uses it: the store and the run (``store``), what the run records
(``run_record``, ``lineage``), the registered models hetflow owns and their versions (``versions``),
the champion gate (``champion``), and the key that tells a repeated training (``training_key``).

Only ``hetflow.tasks.register`` writes to MLflow; ``prepare_data`` and the retrain DAG only read."""
