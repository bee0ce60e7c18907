"""The PostgreSQL adapter: versioned SQL (``sql/``, shipped as ``deploy/sql``), ``migrate``,
the batched ``ExecutionStore`` (``store``) and the LISTEN ``RetirementListener`` (``listener``).
The throwaway server for tests, benchmarks and the demo is a dev tool (``devtools/pg``).

Every expected failure of the database leaves the adapter as a kit error (``errors``: the
taxonomy and the one mapping from asyncpg's exceptions). Depends on the kit, the domain, ports,
config and metrics only; never on the engine or the Kubernetes adapter.
"""

from service.pg import tlsprobe

tlsprobe.install()
