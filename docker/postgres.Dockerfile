# PostgreSQL for the compose stack where the official postgres image cannot be pulled: Debian
# bookworm's postgresql-15 on the offline base (docker/base-image.sh), built by
# docker/stack-images.sh. Its entry point does what the official image's does for compose.yaml
# (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB, /docker-entrypoint-initdb.d) and runs as the
# postgres user throughout.
ARG BASE_IMAGE=hetflow-base:bookworm
FROM ${BASE_IMAGE}
# The postgres user has the official image's uid (999), made before the package would pick one.
# No cluster made by the package: the entry point makes one in the data volume.
# hadolint ignore=DL3008
RUN groupadd --system --gid 999 postgres \
    && useradd --system --uid 999 --gid postgres --home-dir /var/lib/postgresql --shell /bin/sh postgres \
    && mkdir -p /etc/postgresql-common/createcluster.d \
    && echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/no-main-cluster.conf \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data \
    && install -d -o postgres -g postgres -m 2775 /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER 999
# Fast shutdown, as the official image: SIGTERM would wait for every client to disconnect.
STOPSIGNAL SIGINT
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
