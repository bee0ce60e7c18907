"""Retired but kept: which cached pods have a retired execution row yet are not deleted, why, and
since when (docs/architecture.md, "Retired but kept").

Some kept pods are leaks only a person can fix (a Running pod of a retired execution, a
half-started sandbox, a forgotten keep annotation). :class:`KeptPods` (``view.py``) knows them
beside the engine, which never consults it: a pod is kept when it is cached, its row is inactive
and the classifier's verdict on the two is a skip. It learns from the listener's notifications
(a re-activation removes the pod at once; an inactive row makes it a suspect, confirmed by one
row query a namespace), from the informer's cache, and from a sweep of each
namespace every ``period_s``; a pod kept longer than ``bound_s`` gets a ``RetiredPodKept`` Event
once its row was read again (``events.py``). Only the leader keeps the view.
"""
