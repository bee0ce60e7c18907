"""Runbook kubectl commands the emulator serves, run with the real kubectl (tests/kubectl.py):
keeping and releasing a pod (docs/operations.md, "Keeping a pod for debugging") and reading the
leader from the Lease (Install, "Check"); the Event queries of "Why was this pod deleted?"."""

from __future__ import annotations

import json
import re
from pathlib import Path

from devtools.emulator import Emulator
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from tests.kubectl import KubectlCluster

NS = "sandboxes"
WIRE = Path(__file__).parent.parent / "fixtures" / "wire"
KEEP = "retired-pod-gc.space.sandbox/keep"
POD = "space-sbx-a-g1"


def annotations(cluster: KubectlCluster, name: str) -> dict[str, str]:
    pod = json.loads(cluster.run("-n", NS, "get", "pod", name, "-o", "json").stdout)
    found: dict[str, str] = pod["metadata"].get("annotations") or {}
    return found


def test_keep_and_release_a_pod(kubectl_cluster: KubectlCluster) -> None:
    def seed(emu: Emulator) -> None:
        emu.create_pod(
            sandbox_pod(sandbox_id="a", generation=1, shape=Shape.SUCCEEDED), namespace=NS
        )
        emu.create_pod(sandbox_pod(sandbox_id="b", generation=1), namespace=NS)

    kubectl_cluster.call(seed)
    kubectl_cluster.run("-n", NS, "annotate", "pod", POD, f"{KEEP}=true")
    assert annotations(kubectl_cluster, POD) == {KEEP: "true"}
    assert kubectl_cluster.call(lambda emu: emu.get_pod(NS, POD))["metadata"]["annotations"] == {
        KEEP: "true"
    }
    kept = kubectl_cluster.run(
        "-n",
        NS,
        "get",
        "pods",
        "-o",
        "jsonpath={.items[?(@.metadata.annotations.retired-pod-gc\\.space\\.sandbox/keep)].metadata.name}",
    )
    assert kept.stdout.split() == [POD]
    kubectl_cluster.run("-n", NS, "annotate", "pod", POD, f"{KEEP}-")
    assert annotations(kubectl_cluster, POD) == {}


def test_the_leader_from_the_lease(kubectl_cluster: KubectlCluster) -> None:
    holder = "retired-pod-gc-6d9f7c-abcde"
    kubectl_cluster.seed_lease(holder=holder)
    got = kubectl_cluster.run(
        "-n",
        "retired-pod-gc",
        "get",
        "lease",
        "retired-pod-gc",
        "-o",
        "jsonpath={.spec.holderIdentity}",
    )
    assert got.stdout == holder
    missing = kubectl_cluster.run("-n", "retired-pod-gc", "get", "lease", "other", check=False)
    assert missing.returncode == 1 and "NotFound" in missing.stderr


def test_why_was_this_pod_deleted(kubectl_cluster: KubectlCluster) -> None:
    """The Event queries of docs/operations.md, "Why was this pod deleted?", on an Event shaped
    as the controller writes it (the wire sample of an events.k8s.io/v1 create)."""
    sample = json.loads((WIRE / "event-create.201.json").read_text())["body"]

    def seed(emu: Emulator) -> tuple[str, str]:
        pod = emu.create_pod(
            sandbox_pod(sandbox_id="a", generation=1, shape=Shape.PENDING_STUCK), namespace=NS
        )
        for reason, name in (("RetiredPodDeleted", POD), ("RetiredPodWouldDelete", "other")):
            emu.events.create(
                NS,
                {
                    "metadata": {"name": f"{name}.18eccb7e70eb139a"},
                    **{k: sample[k] for k in ("eventTime", "reportingController", "action")},
                    "reportingInstance": sample["reportingInstance"],
                    "reason": reason,
                    "note": f"{reason} note",
                    "type": "Normal",
                    "regarding": {
                        "kind": "Pod",
                        "namespace": NS,
                        "name": name,
                        "uid": pod["metadata"]["uid"] if name == POD else "other-uid",
                        "apiVersion": "v1",
                    },
                },
            )
        return pod["metadata"]["uid"], pod["metadata"]["name"]

    uid, name = kubectl_cluster.call(seed)

    def listed(*args: str) -> list[str]:
        out = kubectl_cluster.run("-n", NS, "get", *args, "-o", "json").stdout
        return [item["reason"] for item in json.loads(out)["items"]]

    assert listed("events", "--field-selector", "reason=RetiredPodDeleted") == ["RetiredPodDeleted"]
    assert listed("events", "--field-selector", "reason=RetiredPodWouldDelete") == [
        "RetiredPodWouldDelete"
    ]
    assert listed("events", "--field-selector", f"involvedObject.name={name}") == [
        "RetiredPodDeleted"
    ]
    assert listed("events", "--field-selector", f"involvedObject.uid={uid}") == [
        "RetiredPodDeleted"
    ]
    assert listed("events.events.k8s.io", "--field-selector", f"regarding.uid={uid}") == [
        "RetiredPodDeleted"
    ]
    table = kubectl_cluster.run(
        "-n", NS, "get", "events", "--field-selector", "reason=RetiredPodDeleted"
    )
    header, *rows = table.stdout.splitlines()
    assert re.split(r"\s{2,}", header.strip()) == [
        "LAST SEEN",
        "TYPE",
        "REASON",
        "OBJECT",
        "MESSAGE",
    ]
    assert [re.split(r"\s{2,}", row.strip())[1:] for row in rows] == [
        ["Normal", "RetiredPodDeleted", f"pod/{name}", "RetiredPodDeleted note"]
    ]
    described = kubectl_cluster.run("-n", NS, "describe", "pod", name).stdout
    assert "RetiredPodDeleted" in described.split("Events:", 1)[1]
