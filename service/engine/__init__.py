"""The reconcile engine: work queue, observation clocks, delete budget, reconciler, controller.

Depends only on the domain, the classifier, the ports, metrics and configuration (import-linter
keeps the Kubernetes and PostgreSQL adapters out); ``service.app`` wires adapters into it.
"""
