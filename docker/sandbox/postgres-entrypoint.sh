#!/bin/sh
# initdb on first start (password auth from the network, as the official image), then run.
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pw=$(mktemp); echo "$POSTGRES_PASSWORD" > "$pw"; chown postgres "$pw"
    runuser -u postgres -- initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pw" \
        --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --locale=C
    rm -f "$pw"
    echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
    runuser -u postgres -- pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
    runuser -u postgres -- psql -U "$POSTGRES_USER" -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
    runuser -u postgres -- pg_ctl -D "$PGDATA" -m fast -w stop
fi
exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*'
