"""Tuning: a study searching strategy, cluster and optimizer settings for the shortest time to a
target accuracy (the hetflow_tune DAG, `hetflow tune`)."""
