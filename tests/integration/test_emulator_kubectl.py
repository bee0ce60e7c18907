"""Runbook kubectl commands the emulator serves, run with the real kubectl (tests/kubectl.py):
keeping and releasing a pod (docs/operations.md, "Keeping a pod for debugging") and reading the
leader from the Lease (Install, "Check")."""

from __future__ import annotations

import json

from devtools.emulator import Emulator
from devtools.emulator.sandboxpods import Shape, sandbox_pod
from tests.kubectl import KubectlCluster

NS = "sandboxes"
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
