"""The developer stack: ``make up`` / ``make down`` start and stop Airflow 3 and the MLflow server on
127.0.0.1 over hetflow's own stores, and ``make up-docker`` writes the env file the docker compose
stack starts with. It is a tool for working on hetflow, not a part of the pipeline: it imports from
``tasks`` (the stores' locations, the Airflow environment, the teardown of runs), and nothing under
``hetflow/``, ``dags/`` or ``plugins/`` imports it.
"""
