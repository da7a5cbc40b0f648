# Prometheus or Alertmanager from Debian's packages (PACKAGE=prometheus | prometheus-alertmanager),
# on the base image the rendezvous is built from, so the compose `monitoring` profile needs no
# registry but Debian's (compose/prepare.sh writes KAFILA_BASE_IMAGE where Docker Hub is not reached).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG PACKAGE
RUN test -n "$PACKAGE" \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$PACKAGE" \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown nobody:nogroup /data
USER nobody
WORKDIR /data
