# A stand-in for the official postgres:15-bookworm image where no registry is reachable (the
# sandbox of ../shared/tools/docker-sandbox.sh): Debian's PostgreSQL 15 with the few parts of
# the official entrypoint the compose `scale` profile uses (POSTGRES_USER / _PASSWORD / _DB,
# data in /var/lib/postgresql/data, pg_isready on PATH). Tagged postgres:15-bookworm by
# docker/scale-smoke.sh so docker-compose.yml runs unchanged.
ARG BASE_IMAGE=local/python:3.11-bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
EXPOSE 5432
CMD ["sh", "/usr/local/bin/postgres-entrypoint.sh"]
