"""Benchmarks of retired-pod-gc: the event-driven service against the seed's polling design.

Run with ``make bench`` (default size) or ``make bench-large`` (100k pods); see RESULTS.md.
Nothing here is imported by the service or the tests, and nothing here asserts a timing.
"""
