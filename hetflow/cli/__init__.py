"""The ``hetflow`` command (``main``): validate a spec, run the DAG through Airflow (``dag_run``,
with ``live_view`` on the terminal), train only, or sweep what interrupted runs left."""
