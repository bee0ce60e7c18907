# retired-pod-gc container image. Build from the repository root:
#   docker build -t retired-pod-gc:0.1.0 .
# Two stages: the first installs the package and its dependencies into a virtualenv (every
# dependency ships wheels for CPython 3.11 on Linux, so no compiler is needed even there); the
# final stage copies only that virtualenv onto a fresh slim base. No pip cache, no build tools,
# no source tree in the final image. Pin the base by digest in your registry mirror if you can;
# the tag is the pin here.
FROM python:3.11-slim-bookworm AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY service ./service
# Non-editable install: the final image needs the installed package, not /src.
RUN /opt/venv/bin/pip install --no-cache-dir . \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

FROM python:3.11-slim-bookworm

# Bytecode is compiled at build time; the root filesystem is read-only at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

COPY --from=build /opt/venv /opt/venv

# Numeric UID/GID (matches runAsUser/runAsGroup in deploy/base/deployment.yaml), so Kubernetes
# can verify runAsNonRoot without a passwd entry.
USER 10001:10001

EXPOSE 8080
ENTRYPOINT ["retired-pod-gc"]
CMD ["run"]
