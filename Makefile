# hetflow: `make run` and `make test` set themselves up on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
PIP_VERSION := 26.3
PIP_READY := $(VENV)/.pip-$(PIP_VERSION)
WHEELHOUSE := build/wheelhouse

.PHONY: setup sandbox test-deps engine image compose-cli stack-images run serve test test-all test-fast bench bench-overhead bench-peer bench-deploy chaos lint lint-docker up down up-docker down-docker clean docs

$(PIP_READY):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==$(PIP_VERSION)
	touch $@

# Every pin as a wheel, fetched once: the venv installs from here and the replica image's build copies from
# here (docker/build-image.sh), so TensorFlow's 570 MB wheel crosses the network once. pip resumes a cut
# download; one that stops resuming (a CI run's did, at 409 of 572 MB) is started again, twice at most.
$(WHEELHOUSE)/.complete: requirements.lock | $(PIP_READY)
	@for attempt in 1 2 3; do \
		$(BIN)/pip wheel --quiet --resume-retries 10 --wheel-dir $(WHEELHOUSE) -r requirements.lock && break; \
		[ $$attempt = 3 ] && exit 1; \
		echo "wheelhouse: a download failed (attempt $$attempt of 3); starting again in 30 s" >&2; sleep 30; \
	done
	touch $@

$(INSTALLED): $(PIP_READY) $(WHEELHOUSE)/.complete pyproject.toml
	$(BIN)/pip install --quiet --no-index --find-links $(WHEELHOUSE) -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

setup: $(INSTALLED)

## the sandbox of local replicas and model servers (hetflow/sandbox.py): Debian's bubblewrap; setpriv drops root;
## the container tools' default seccomp profile (hetflow/seccomp.py), as Debian's golang-github-containers-common ships it;
## the serving endpoint's load balancer (hetflow/serving/balancer.py): Debian's haproxy, its Prometheus exporter built in
sandbox:
	@command -v bwrap >/dev/null && command -v setpriv >/dev/null && [ -f /usr/share/containers/seccomp.json ] && \
		[ -x /usr/sbin/haproxy ] || \
		{ $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		bubblewrap util-linux golang-github-containers-common haproxy; }

# make run's job: a real cluster of two sync workers (local processes) on the embedded data.
RUN_SPEC ?= --set strategy=multi_worker_mirrored --set workers=2

## run hetflow_train once through Airflow (extra spec keys: ARGS="--set epochs=5"; the whole log: ARGS=-v)
run: setup sandbox
	$(BIN)/hetflow run $(RUN_SPEC) $(ARGS)

## serve each registered model's champion on 127.0.0.1:8501, TF Serving's REST API, following the alias to each new
## champion through a canary; Ctrl-C stops it and everything it started (options: ARGS="--model hetflow-digits --replicas 2")
serve: setup sandbox
	$(BIN)/hetflow serve $(ARGS)

## what the tests need beyond .venv: the browser the UI tests drive, a compose CLI, a Docker engine and the
## replica image (where no engine can start, the container tests skip and say why)
test-deps: setup sandbox
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@# flatc decodes the TFLite metadata hetflow writes against TFLite Support's schema (tests/schemas/)
	@command -v flatc >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq flatbuffers-compiler; }
	@# the compose CLI checks docker/compose.yaml's required secrets offline (`config` needs no engine)
	@# and starts the stack (`up --wait`, Compose v2); where v2 cannot be installed, v1 still checks
	@docker/compose-cli.sh || command -v docker-compose >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; }
	@if docker/engine.sh; then docker/build-image.sh; fi

## a Docker engine on this machine (Debian's docker.io, dockerd started as root)
engine:
	docker/engine.sh

## the replica image (docker/Dockerfile), its base built offline where no registry is reachable
image: setup engine
	docker/build-image.sh

## a Docker Swarm of two unequal nodes on this machine (containers running their own dockerd), HETFLOW_HOME
## shared, the replica image on each; prints the DOCKER_HOST for backend=swarm (docker/swarm.sh says more)
swarm: image
	docker/swarm.sh up

swarm-down:
	docker/swarm.sh down

## every test but the heavy tier (CI's suite): unit, multi-process, containers, end to end through
## Airflow, MLflow and a browser
test: test-deps
	$(BIN)/pytest -v --durations=80 -m "not heavy"

## every test: also the heavy tier, which brings up the compose stack (its images built first) and the swarm
## (runs across its nodes, one lost mid-run), and runs second variants of make test's scenarios
test-all: test-deps
	@if docker/engine.sh; then docker/stack-images.sh; fi
	$(BIN)/pytest -v --durations=30

## the tests that start no TensorFlow replica and no DAG run (tests/replica_guard.py enforces the first)
test-fast: setup
	$(BIN)/pytest -v -m "not slow and not replicas"

## training throughput per strategy (bench/RESULTS.md, subset: ARGS="--cases baseline,one_worker") compression (bench/COMPRESSION.md), stragglers (bench/STRAGGLER.md; on a swarm of unequal nodes: bench/STRAGGLER-SWARM.md), model parallelism (bench/MODEL_PARALLEL.md; where pipelining's time goes: bench/PIPELINE_OVERLAP.md), containers vs processes on local, docker and swarm (bench/CONTAINERS.md), a default run's fixed overhead (bench/OVERHEAD.md) and the endpoint of hetflow serve (bench/DEPLOY.md); the swarm benches bring their own swarm up and down (docker/swarm.sh)
bench: setup image
	$(BIN)/python bench/run.py $(ARGS)
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/straggler.py
	$(BIN)/python bench/straggler.py --backend swarm
	$(BIN)/python bench/model_parallel.py
	$(BIN)/python bench/pipeline_overlap.py
	$(BIN)/python bench/live_logging.py
	$(BIN)/python bench/tune.py
	$(BIN)/python bench/containers.py
	$(BIN)/python bench/overhead.py $(RUN_SPEC)
	$(BIN)/python bench/deploy.py

## make run's job once, timed: DAG wall time less training, per stage imports / MLflow I/O / work (bench/OVERHEAD.md)
bench-overhead: setup
	$(BIN)/python bench/overhead.py $(RUN_SPEC)

## the throughput cases beside a peer, Ray Train on the same job (bench/RESULTS.md: mwms_2 / ray_2w); installs bench/ray-requirements.lock into .bench-ray on first use
bench-peer: setup
	$(BIN)/python bench/run.py --cases baseline,one_worker,mwms_2,two_apart,ray_2w $(ARGS)

## the endpoint of hetflow serve on loopback (bench/DEPLOY.md): capacity, 20 champion swaps under a steady load, bad
## candidates rolled back, memory during a swap, vs a model server called directly, 2 replicas and mlflow models serve
bench-deploy: setup sandbox
	$(BIN)/python bench/deploy.py $(ARGS)

## runs that lose a random replica at a random time (bench/CHAOS.md)
chaos: setup image
	$(BIN)/python bench/chaos.py $(ARGS)

## docs/spec.md, the spec reference, generated from RunSpec (tests/test_spec_reference.py fails when it is stale)
docs: setup
	$(BIN)/python -m hetflow.spec.reference > docs/spec.md

## style and static checks
lint: setup lint-docker
	$(BIN)/ruff check hetflow devstack tests dags plugins bench
	$(BIN)/ruff format --check hetflow devstack tests dags plugins bench

## the Dockerfiles (hadolint) and the compose file (compose-spec schema), offline
lint-docker: setup
	$(BIN)/hadolint docker/Dockerfile docker/stack.Dockerfile docker/postgres.Dockerfile docker/swarm-node.Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml

# make up options: ports, DB=postgres (Debian's PostgreSQL as Airflow's metadata DB, installed when
# missing), LOGIN=off (no Airflow login: everyone is admin, for local development only).
AIRFLOW_PORT ?= 8080
MLFLOW_PORT ?= 5000
SERVE_PORT ?= 8501
DB ?= sqlite
LOGIN ?= on
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

## Airflow (api-server, scheduler, dag-processor, triggerer), the MLflow server and hetflow serve's endpoint (SERVE_PORT,
## 8501) on 127.0.0.1, same stores as make run
up: setup sandbox
	@if [ "$(DB)" = postgres ] && ! command -v pg_ctlcluster >/dev/null; then \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq postgresql; fi
	$(BIN)/python -m devstack.stack up --airflow-port $(AIRFLOW_PORT) --mlflow-port $(MLFLOW_PORT) --serve-port $(SERVE_PORT) \
		$(if $(filter postgres,$(DB)),--postgres) $(if $(filter off,$(LOGIN)),--no-login)

## stop everything make up started
down:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m devstack.stack down; fi

# The compose file has no default secrets: devstack/compose_env.py writes them (generated once per
# HETFLOW_HOME, 0600) with the uid and the socket's group, the ports and the images
# docker/stack-images.sh chose into the env file, on every call; LOGIN=off and the ports as for
# make up. The password is in .hetflow/stack/passwords.json, never printed.
# HETFLOW_HOME is set for compose too: a variable of the caller's environment would outrank the env file's.
COMPOSE_ENV = HETFLOW_HOME=$(CURDIR)/.hetflow $(BIN)/python -m devstack.compose_env \
	--airflow-port $(AIRFLOW_PORT) --mlflow-port $(MLFLOW_PORT) --serve-port $(SERVE_PORT) $(if $(filter off,$(LOGIN)),--no-login)
COMPOSE = HETFLOW_HOME=$(CURDIR)/.hetflow docker compose --env-file $(CURDIR)/.hetflow/stack/compose.env -f docker/compose.yaml

## `docker compose` (Compose v2: up --wait), installed as the docker CLI's plugin where missing
compose-cli:
	docker/compose-cli.sh

## the compose stack's images: PostgreSQL (the official image, else built offline) and Airflow+MLflow
stack-images: image
	docker/stack-images.sh

## the compose stack (PostgreSQL, Airflow, MLflow, hetflow serve's endpoint) on this host's Docker engine, healthy, and the replica image
up-docker: compose-cli stack-images
	$(COMPOSE_ENV) >/dev/null
	@started=$$(date +%s) && $(COMPOSE) up --detach --wait && \
		$(COMPOSE_ENV) --healthy-after $$(( $$(date +%s) - started ))

## stop the compose stack: its containers and network go, the volume with its databases stays
down-docker: setup
	$(COMPOSE_ENV) >/dev/null
	$(COMPOSE) down --remove-orphans

clean: down
	rm -rf .hetflow mlflow/mlflow.db mlflow/artifacts
