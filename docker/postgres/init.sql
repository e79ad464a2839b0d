-- The compose stack's one PostgreSQL server holds two databases: Airflow's metadata (the
-- server's default database, POSTGRES_DB) and MLflow's tracking store and model registry.
CREATE DATABASE mlflow OWNER hetflow;
