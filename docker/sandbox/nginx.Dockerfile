# A stand-in for the official nginx:1.27-bookworm image where no registry is reachable:
# Debian's nginx, run in the foreground. Tagged nginx:1.27-bookworm by docker/scale-smoke.sh.
ARG BASE_IMAGE=local/python:3.11-bookworm
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/*
CMD ["nginx", "-g", "daemon off;"]
