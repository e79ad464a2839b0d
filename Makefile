# hetflow: `make run` and `make test` set themselves up on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
PIP_VERSION := 26.3

.PHONY: setup test-deps engine image run test test-fast bench chaos lint lint-docker up down up-docker down-docker clean

$(INSTALLED): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==$(PIP_VERSION)
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

setup: $(INSTALLED)

# make run's job: a real cluster of two sync workers (local processes) on the embedded data.
RUN_SPEC ?= --set strategy=multi_worker_mirrored --set workers=2

## run hetflow_train once through Airflow (extra spec keys: ARGS="--set epochs=5"; the whole log: ARGS=-v)
run: setup
	$(BIN)/hetflow run $(RUN_SPEC) $(ARGS)

## what the tests need beyond .venv: the browser the UI tests drive, a Docker engine and the replica
## image (where no engine can start, the container tests skip and say why)
test-deps: setup
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@if docker/engine.sh; then docker/build-image.sh; fi

## a Docker engine on this machine (Debian's docker.io, dockerd started as root)
engine:
	docker/engine.sh

## the replica image (docker/Dockerfile), its base built offline where no registry is reachable
image: setup engine
	docker/build-image.sh

## every test, the slow end-to-end tier included
test: test-deps
	$(BIN)/pytest -v --durations=30

## unit tests only (seconds)
test-fast: setup
	$(BIN)/pytest -v -m "not slow"

## training throughput per strategy (bench/RESULTS.md, subset: ARGS="--cases baseline,one_worker") compression (bench/COMPRESSION.md), stragglers (bench/STRAGGLER.md) and containers vs processes (bench/CONTAINERS.md)
bench: setup image
	$(BIN)/python bench/run.py $(ARGS)
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/straggler.py
	$(BIN)/python bench/containers.py

## runs that lose a random replica at a random time (bench/CHAOS.md)
chaos: setup
	$(BIN)/python bench/chaos.py $(ARGS)

## style and static checks
lint: setup lint-docker
	$(BIN)/ruff check tasks tests dags plugins bench
	$(BIN)/ruff format --check tasks tests dags plugins bench

## the Dockerfiles (hadolint) and the compose file (compose-spec schema), offline
lint-docker: setup
	$(BIN)/hadolint docker/Dockerfile docker/stack.Dockerfile
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
up-docker: image
	mkdir -p .hetflow
	HETFLOW_HOME=$(CURDIR)/.hetflow HETFLOW_UID=$$(id -u) DOCKER_GID=$$(stat -c %g /var/run/docker.sock) \
		docker compose -f docker/compose.yaml up --build --detach --wait

down-docker:
	HETFLOW_HOME=$(CURDIR)/.hetflow docker compose -f docker/compose.yaml down

clean: down
	rm -rf .hetflow mlflow/mlflow.db mlflow/artifacts
