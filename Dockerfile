# retired-pod-gc container image. Build from the repository root (docs/operations.md, "The image"):
#   make image       # docker build with VERSION, REVISION and SOURCE from pyproject.toml and git
# Two stages. The first builds a virtualenv from the locks (requirements.lock: the runtime
# dependencies of pyproject.toml; requirements-build.lock: its build backend; `make lock`
# refreshes both): every file is checked against its sha256 and nothing is resolved or fetched
# that the locks do not name. The virtualenv never has pip, setuptools or wheel (it is created
# without pip and filled by the build stage's own pip). The final stage copies only that
# virtualenv onto a fresh slim base, from which the base's own pip, setuptools and wheel are
# removed. No pip cache, no build tools, no source tree, no dev tools in the final image. Pin the
# base by digest in your registry mirror if you can; the tag is the pin here.
FROM python:3.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
COPY requirements.lock requirements-build.lock ./
# /opt/build: the build backend (hatchling), only in this stage. /opt/venv: what the image runs.
RUN python -m venv /opt/build \
    && /opt/build/bin/pip install --require-hashes --no-deps -r requirements-build.lock \
    && python -m venv --without-pip /opt/venv \
    && /opt/build/bin/pip --python /opt/venv/bin/python install --require-hashes --no-deps \
        -r requirements.lock
COPY pyproject.toml README.md ./
COPY service ./service
# The project itself: a wheel built offline by the locked backend, installed without
# dependencies (they are all in already) and without an index.
RUN /opt/build/bin/pip wheel --no-build-isolation --no-deps --no-index --wheel-dir /tmp/dist . \
    && /opt/build/bin/pip --python /opt/venv/bin/python install --no-deps --no-index \
        /tmp/dist/retired_pod_gc-*.whl \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

FROM python:3.11-slim-bookworm

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="retired-pod-gc" \
      org.opencontainers.image.description="Kubernetes controller that deletes sandbox pods whose execution was retired in PostgreSQL" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"

# Bytecode is compiled at build time; the root filesystem is read-only at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Nothing installs anything at run time: the base's pip, setuptools and wheel go, and so do
# ensurepip's bundled copies of them.
RUN PIP_ROOT_USER_ACTION=ignore python -m pip uninstall --yes --quiet pip setuptools wheel \
    && rm -rf /usr/local/lib/python3.11/ensurepip

COPY --from=build /opt/venv /opt/venv

# Numeric UID/GID (matches runAsUser/runAsGroup in deploy/base/deployment.yaml), so Kubernetes
# can verify runAsNonRoot without a passwd entry.
USER 10001:10001

EXPOSE 8080
# Every command ends on SIGTERM (exit 143; `run` drains first and exits 0) and SIGINT (130),
# as PID 1 too: no init process is needed (service/app/signals.py).
ENTRYPOINT ["retired-pod-gc"]
CMD ["run"]
