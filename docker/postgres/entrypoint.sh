#!/bin/sh
# Entry point of docker/postgres.Dockerfile. On an empty data directory: a cluster whose superuser
# is POSTGRES_USER with POSTGRES_PASSWORD (scram-sha-256 over the network), the database
# POSTGRES_DB, then the SQL files in /docker-entrypoint-initdb.d, run by a server that listens on no
# TCP port and on a socket the healthcheck does not look at, so the stack waits for the real start.
# Then the server, on the container's network.
set -eu
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    init_socket=$(mktemp -d)
    pg_ctl --wait --silent -D "$PGDATA" -o "-c listen_addresses='' -k $init_socket" start
    if [ "$POSTGRES_DB" != postgres ]; then
        psql -q -v ON_ERROR_STOP=1 -h "$init_socket" -U "$POSTGRES_USER" -d postgres \
            -c "CREATE DATABASE \"$POSTGRES_DB\""
    fi
    for script in /docker-entrypoint-initdb.d/*.sql; do
        [ -e "$script" ] || continue
        psql -q -v ON_ERROR_STOP=1 -h "$init_socket" -U "$POSTGRES_USER" -d "$POSTGRES_DB" -f "$script"
    done
    pg_ctl --wait --silent -D "$PGDATA" -m fast stop
    echo "postgres-entrypoint: cluster made in $PGDATA (superuser $POSTGRES_USER, database $POSTGRES_DB)"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
