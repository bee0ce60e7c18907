"""Retired but kept: which cached pods have a retired execution row yet are not deleted, why, and
since when (docs/architecture.md, "Retired but kept").

The controller keeps every pod but two safe shapes; some kept pods are leaks only a person can
fix (a Running pod of a retired execution, a half-started sandbox, a forgotten keep annotation).
:class:`KeptPods` knows them beside the engine: it deletes nothing, and the pipeline never
consults it. A pod is kept when it is cached, its row (found as the reconciler finds it) is
inactive, and the classifier's verdict on the two is a skip, whose reason it shows.

The view is fed by the listener's notifications (a re-activation removes the pod at once; an
inactive row makes it a suspect, confirmed by one row query per namespace), by the informer's
cache (a pod whose retired row is known is classified again when it changes), and by a sweep of
each namespace every ``period_s``: one row query for all its cached pods, which finds what no
notification named. Gauges per reason are refreshed every tick; a pod kept longer than
``bound_s`` gets a ``RetiredPodKept`` Event once its row was read again
(``events.py``). Only the leader keeps the view; losing the lease empties it.
"""

from service.engine.kept.model import KeptPod, severity_of
from service.engine.kept.view import KeptPods

__all__ = ["KeptPod", "KeptPods", "severity_of"]
