# The compose stack's Airflow and MLflow services (docker/compose.yaml), built by
# docker/stack-images.sh on the replica image's dependency stage (docker/Dockerfile's `runtime`:
# the base, its venv with TensorFlow and the rest a replica imports), so the two images share those
# layers and this build adds only Airflow, MLflow and what they pull in. The build context holds
# only what is copied here: requirements.lock, a wheelhouse of the pins the runtime lacks (built
# on the host), the code and the DAGs. No pip index is used inside the build.
ARG RUNTIME_IMAGE=hetflow-replica-runtime:0.1.0
FROM ${RUNTIME_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH=/opt/hetflow
# The tasks run what others wrote (register's served check starts a registered model's server)
# under bubblewrap, as on the host (hetflow/sandbox.py), with the container tools' seccomp profile
# (hetflow/seccomp.py: /usr/share/containers/seccomp.json); the endpoint service (hetflow serve)
# too, behind Debian's HAProxy.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap \
        golang-github-containers-common haproxy \
    && rm -rf /var/lib/apt/lists/*
COPY requirements.lock /tmp/
COPY wheelhouse /tmp/wheelhouse
RUN pip install --no-index --find-links /tmp/wheelhouse -r /tmp/requirements.lock && rm -rf /tmp/wheelhouse
# /opt/hetflow is the checkout's layout (hetflow.paths.REPO_ROOT): the scheduler's backend=docker
# preflight digests hetflow/ and the pins there to match the replica image's label.
WORKDIR /opt/hetflow
COPY requirements.lock ./
COPY replica-requirements.txt ./docker/
COPY hetflow ./hetflow
COPY dags ./dags
COPY plugins ./plugins
USER 10001
