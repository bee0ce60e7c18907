"""The kit: building blocks every adapter and the engine need, written once.

``clock`` (time: the event loop's clock, the one source), ``backoff`` (exponential backoff with
jitter), ``ratelimit`` (aiolimiter shaped so that a cap per window holds), ``timeouts`` (a
bounded await: anyio's ``fail_after`` as one object), ``errors`` (the taxonomy of expected
failures of the outside world), ``memory`` (freed heap back to the OS), ``env`` (typed
environment variables) and ``dsn`` (PostgreSQL URLs: checked, masked, read from a file). The
kit imports nothing else of the service; everything above it imports from here instead of
writing its own (docs/architecture.md, "Layers").
"""
