"""The kit: building blocks every adapter and the engine need, written once (time, backoff, rate
limits, bounded awaits, the error taxonomy, typed environment variables, PostgreSQL URLs, ...).
It imports nothing else of the service; everything above it imports from here instead of
writing its own (docs/architecture.md, "Layers").
"""
