"""The PostgreSQL adapter: versioned SQL (``sql/``, shipped as ``deploy/sql``), ``migrate``, the
batched ``ExecutionStore`` (``store``) and the LISTEN ``RetirementListener`` (``listener``).

Every expected failure of the database leaves the adapter as a kit error (``errors``). Depends on
the kit, the domain, ports, config and metrics only; the throwaway server for tests is a dev tool
(``devtools/pg``).
"""

from service.pg import tlsprobe

tlsprobe.install()
