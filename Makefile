# hetflow: `make run` and `make test` set themselves up on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
PIP_VERSION := 26.3

.PHONY: setup run test test-fast bench chaos lint lint-docker up down up-docker down-docker clean

$(INSTALLED): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==$(PIP_VERSION)
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

setup: $(INSTALLED)

## run hetflow_train once through Airflow on the defaults (extra spec keys: ARGS="--set epochs=5")
run: setup
	$(BIN)/hetflow run $(ARGS)

## every test, the slow end-to-end tier included
test: setup
	$(BIN)/pytest -v

## unit tests only (seconds)
test-fast: setup
	$(BIN)/pytest -v -m "not slow"

## training throughput per strategy (bench/RESULTS.md, subset: ARGS="--cases baseline,one_worker") compression (bench/COMPRESSION.md) and stragglers (bench/STRAGGLER.md)
bench: setup
	$(BIN)/python bench/run.py $(ARGS)
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/straggler.py

## runs that lose a random replica at a random time (bench/CHAOS.md)
chaos: setup
	$(BIN)/python bench/chaos.py $(ARGS)

## style and static checks
lint: setup lint-docker
	$(BIN)/ruff check tasks tests dags plugins bench
	$(BIN)/ruff format --check tasks tests dags plugins bench

## the Dockerfile (hadolint) and the compose file (compose-spec schema), offline
lint-docker: setup
	$(BIN)/hadolint docker/Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml

# make up options: ports, DB=postgres (Debian's PostgreSQL as Airflow's metadata DB, installed when
# missing), LOGIN=off (no Airflow login: everyone is admin, for local development only).
AIRFLOW_PORT ?= 8080
MLFLOW_PORT ?= 5000
DB ?= sqlite
LOGIN ?= on
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

## Airflow (api-server, scheduler, dag-processor, triggerer) and the MLflow server on 127.0.0.1, same stores as make run
up: setup
	@if [ "$(DB)" = postgres ] && ! command -v pg_ctlcluster >/dev/null; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq postgresql; fi
	$(BIN)/python -m tasks.stack up --airflow-port $(AIRFLOW_PORT) --mlflow-port $(MLFLOW_PORT) \
		$(if $(filter postgres,$(DB)),--postgres) $(if $(filter off,$(LOGIN)),--no-login)

## stop everything make up started
down:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m tasks.stack down; fi

## the compose stack (PostgreSQL, Airflow, MLflow) on this host's Docker engine, and the replica image
up-docker:
	docker info --format '{{.ServerVersion}}' >/dev/null || { echo "make up-docker: no Docker engine (docker info failed)"; exit 1; }
	mkdir -p .hetflow
	docker build -f docker/Dockerfile -t hetflow-replica:0.1.0 .
	HETFLOW_HOME=$(CURDIR)/.hetflow HETFLOW_UID=$$(id -u) DOCKER_GID=$$(stat -c %g /var/run/docker.sock) \
		docker compose -f docker/compose.yaml up --build --detach --wait

down-docker:
	HETFLOW_HOME=$(CURDIR)/.hetflow docker compose -f docker/compose.yaml down

clean: down
	rm -rf .hetflow mlflow/mlflow.db mlflow/artifacts
