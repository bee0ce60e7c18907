"""PostgreSQL for development: a throwaway server (``throwaway``) and the development data the
tests, the benchmarks and the demo seed through it (``devdata``)."""
