# The compose stack's Airflow and MLflow services (docker/compose.yaml builds it from the repo
# root; stack.Dockerfile.dockerignore keeps the context to what is copied): the whole lock file,
# the package and the DAGs. Needs a pip index, as the compose stack needs a registry anyway.
FROM python:3.11.7-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/hetflow
COPY requirements.lock ./
RUN pip install --no-cache-dir -r requirements.lock
COPY pyproject.toml README.md ./
COPY tasks ./tasks
COPY dags ./dags
COPY plugins ./plugins
RUN pip install --no-cache-dir --no-deps . && useradd --create-home --uid 10001 --user-group hetflow
USER 10001
