"""The wiring: the only package that puts the Kubernetes and PostgreSQL adapters together."""
