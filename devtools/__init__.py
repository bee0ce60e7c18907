"""Tools for the tests, the benchmarks, the demo and newcomers; never part of the product.

``devtools.emulator`` is a Kubernetes API server emulator, ``devtools.pg`` a throwaway
PostgreSQL server and the development data, ``devtools.demo`` the whole loop on both
(``make demo``). The product (``service``) never imports this package (an import-linter
contract in ``pyproject.toml`` says so), and neither the wheel nor the image carries it.
"""
