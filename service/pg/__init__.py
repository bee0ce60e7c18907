"""The PostgreSQL adapter: versioned SQL (``sql/``, shipped as ``deploy/sql``), ``migrate``,
the batched ``ExecutionStore`` (``store``) and the LISTEN ``RetirementListener`` (``listener``).
The throwaway server for tests, benchmarks and the demo is a dev tool (``devtools/pg``).

Depends on the domain, ports, config and metrics only; never on the engine or the Kubernetes
adapter.
"""

from service.pg import tlsprobe

tlsprobe.install()
