"""Cancel-create cleanup: the companion to the API's create-cancel path.

Retire the execution, fenced on generation and activation attempt (one UPDATE); then, only if the
execution naming the pod is retired, delete the pod under the UID of a fresh GET whose labels
match the execution (a pod recreated under the name by a newer activation survives), unless
:func:`service.classifier.kept` keeps it. :class:`CancelOutcome` names each ending.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from service.classifier import kept
from service.domain import KEEP_ANNOTATION, DeleteResult
from service.pg.cancel import retire_for_cancel
from service.ports import PodClient

logger = logging.getLogger(__name__)


class CancelOutcome(enum.StrEnum):
    DELETED = "deleted"
    """The execution is retired and its pod was deleted (or is being deleted)."""
    POD_ABSENT = "pod_absent"
    """The execution is retired and no pod of it exists."""
    LEFT_ALONE_ACTIVE = "left_alone_active"
    """The execution is still active (a newer activation owns it): nothing was deleted."""
    LEFT_ALONE_OTHER_POD = "left_alone_other_pod"
    """The pod under that name belongs to another sandbox or generation: not touched."""
    LEFT_ALONE_KEPT = "left_alone_kept"
    """The pod carries the keep annotation: not deleted (release it and run the command again)."""
    NO_EXECUTION = "no_execution"
    """No execution of that sandbox and generation exists in this namespace."""
    CONFLICT = "conflict"
    """The pod changed between the GET and the DELETE (409): run again."""


@dataclass(frozen=True, slots=True)
class CancelReport:
    outcome: CancelOutcome
    retired_now: bool
    pod_name: str | None
    detail: str = ""


async def cancel_create(
    *,
    conn: Any,
    pods: PodClient,
    namespaces: Sequence[str],
    sandbox_id: str,
    generation: int,
    activation_attempt: int,
    timeout_s: float,
) -> CancelReport:
    """See the module docstring. A failed GET or DELETE raises as the pod client raised it, or
    ``TimeoutError`` (a DELETE without an answer may have been applied): running again is safe."""
    row = await retire_for_cancel(
        conn,
        namespaces=namespaces,
        sandbox_id=sandbox_id,
        generation=generation,
        activation_attempt=activation_attempt,
        timeout_s=timeout_s,
    )
    if row.pod_name is None or row.namespace is None:
        return CancelReport(CancelOutcome.NO_EXECUTION, row.retired_now, None)
    if row.active:
        logger.info(
            "execution still active (activation attempt %s): pod %s left alone",
            row.activation_attempt,
            row.pod_name,
        )
        return CancelReport(CancelOutcome.LEFT_ALONE_ACTIVE, row.retired_now, row.pod_name)
    namespace = row.namespace  # the sandbox's own namespace, one of those configured
    with anyio.fail_after(timeout_s):
        pod = await pods.get_pod(namespace, row.pod_name)
    if pod is None:
        return CancelReport(CancelOutcome.POD_ABSENT, row.retired_now, row.pod_name)
    if pod.sandbox_id != sandbox_id or pod.generation != generation:
        return CancelReport(
            CancelOutcome.LEFT_ALONE_OTHER_POD,
            row.retired_now,
            row.pod_name,
            f"pod labels name sandbox {pod.sandbox_id} generation {pod.generation}",
        )
    keep = kept(pod)
    if keep is not None:
        logger.info("pod %s left alone: %s", row.pod_name, keep.rule)
        return CancelReport(
            CancelOutcome.LEFT_ALONE_KEPT,
            row.retired_now,
            row.pod_name,
            f"{keep.rule}; to release it: kubectl -n {namespace} annotate pod {row.pod_name} "
            f"{KEEP_ANNOTATION}- and run cancel-create again",
        )
    with anyio.fail_after(timeout_s):
        result = await pods.delete_pod(
            namespace, row.pod_name, uid=pod.uid, resource_version=pod.resource_version
        )
    match result.result:
        case DeleteResult.DELETED:
            outcome = CancelOutcome.DELETED
        case DeleteResult.GONE:
            outcome = CancelOutcome.POD_ABSENT
        case DeleteResult.CONFLICT:
            outcome = CancelOutcome.CONFLICT
    logger.info("cancel-create %s: %s", row.pod_name, outcome)
    return CancelReport(outcome, row.retired_now, row.pod_name, result.message)
