"""A small, faithful renderer for the kustomize subset that ``deploy/`` uses.

Why not ``kubectl kustomize``: the tests must run on a fresh machine with only python3, pip, make
and apt, and Debian's kubectl (``kubernetes-client`` 1.20 in bookworm) predates the kustomize
features we rely on. So ``deploy/`` is kept to this subset, and anything outside it fails loudly
here instead of being rendered wrongly:

- ``resources``: YAML files (multi-document) and directories holding a ``kustomization.yaml``;
- ``configMapGenerator`` with ``literals`` and ``files``, ``behavior`` create / merge / replace,
  per-generator ``options`` (``labels``, ``annotations``, ``disableNameSuffixHash``);
- the content-hash name suffix of generated ConfigMaps (kustomize v5's algorithm: sha256 of the
  Go-JSON encoding of kind, an empty name and data; the first ten hex digits with 0, 1, 3, a, e
  re-lettered)
  and the rewrite of every reference to a generated ConfigMap from a pod template.

The output matched ``kubectl kustomize`` (kustomize v5.5.0) object for object when it was written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

_KNOWN_FIELDS = frozenset({"apiVersion", "kind", "resources", "configMapGenerator"})
_GENERATOR_FIELDS = frozenset({"name", "namespace", "behavior", "literals", "files", "options"})
_OPTION_FIELDS = frozenset({"labels", "annotations", "disableNameSuffixHash"})


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


@dataclass
class _Generated:
    obj: Obj
    hashed: bool


@dataclass
class _Rendered:
    objects: list[Obj] = field(default_factory=list)
    generated: dict[tuple[str, str], _Generated] = field(default_factory=dict)
    """(namespace, name) of each generated ConfigMap, before the hash suffix."""


def render(directory: Path) -> list[Obj]:
    """Render the kustomization in ``directory`` into a list of Kubernetes objects."""
    rendered = _render(directory.resolve(), seen=())
    renames: dict[tuple[str, str], str] = {}
    for (namespace, name), gen in rendered.generated.items():
        if gen.hashed:
            new_name = f"{name}-{configmap_hash(gen.obj)}"
            gen.obj["metadata"]["name"] = new_name
            renames[(namespace, name)] = new_name
    for obj in rendered.objects:
        _rewrite_configmap_refs(obj, renames)
    return rendered.objects


def configmap_hash(cm: Obj) -> str:
    """kustomize's ``ConfigMapHash``: the suffix of a generated ConfigMap's name."""
    # kustomize v5 looks the name up with the single key "metadata/name", which never matches,
    # so the name it hashes is always "" (api/hasher/hasher.go); immutable is not hashed.
    encoded: Obj = {"kind": "ConfigMap", "name": "", "data": cm.get("data", {})}
    if isinstance(cm.get("binaryData"), dict):
        encoded["binaryData"] = cm["binaryData"]
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # Go's encoding/json escapes these; the hash is over Go's bytes.
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")):
        text = text.replace(char, escaped)
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _render(directory: Path, *, seen: tuple[Path, ...]) -> _Rendered:
    if directory in seen:
        raise UnsupportedKustomization(f"cycle through {directory}")
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(kustomization) - _KNOWN_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"{directory}: unsupported fields {sorted(unknown)}")
    out = _Rendered()
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            child = _render(path, seen=(*seen, directory))
            out.objects.extend(child.objects)
            for key, gen in child.generated.items():
                if key in out.generated:
                    raise UnsupportedKustomization(f"ConfigMap {key} generated twice")
                out.generated[key] = gen
        else:
            docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
            out.objects.extend(d for d in docs if d is not None)
    for generator in kustomization.get("configMapGenerator", []):
        _apply_generator(directory, generator, out)
    return out


def _apply_generator(directory: Path, generator: Obj, out: _Rendered) -> None:
    unknown = set(generator) - _GENERATOR_FIELDS
    options = generator.get("options", {})
    unknown |= set(options) - _OPTION_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"configMapGenerator: unsupported fields {sorted(unknown)}")
    name = generator["name"]
    namespace = generator.get("namespace", "default")
    data: dict[str, str] = {}
    for literal in generator.get("literals", []):
        key, sep, value = literal.partition("=")
        if not sep:
            raise UnsupportedKustomization(f"literal without '=': {literal!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        data[key] = value
    for entry in generator.get("files", []):
        key, sep, rel = entry.partition("=")
        if not sep:
            key, rel = Path(entry).name, entry
        data[key] = (directory / rel).read_text(encoding="utf-8")
    behavior = generator.get("behavior", "create")
    existing = out.generated.get((namespace, name))
    if behavior == "create":
        if existing is not None:
            raise UnsupportedKustomization(f"ConfigMap {namespace}/{name} already generated")
        obj: Obj = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace},
            "data": data,
        }
        out.objects.append(obj)
        existing = _Generated(obj=obj, hashed=True)
        out.generated[(namespace, name)] = existing
    elif behavior in ("merge", "replace"):
        if existing is None:
            raise UnsupportedKustomization(
                f"{behavior}: no ConfigMap {namespace}/{name} to {behavior}"
            )
        if behavior == "merge":
            existing.obj["data"] = {**existing.obj.get("data", {}), **data}
        else:
            existing.obj["data"] = data
    else:
        raise UnsupportedKustomization(f"configMapGenerator behavior {behavior!r}")
    meta = existing.obj["metadata"]
    for kind in ("labels", "annotations"):
        if options.get(kind):
            meta[kind] = {**meta.get(kind, {}), **options[kind]}
    if options.get("disableNameSuffixHash"):
        existing.hashed = False


def _rewrite_configmap_refs(obj: Obj, renames: dict[tuple[str, str], str]) -> None:
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec") if obj.get("kind") != "Pod" else spec
    if not pod:
        return
    namespace = obj.get("metadata", {}).get("namespace", "default")

    def renamed(name: str) -> str:
        return renames.get((namespace, name), name)

    for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                source["configMapRef"]["name"] = renamed(source["configMapRef"]["name"])
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref is not None:
                ref["name"] = renamed(ref["name"])
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"]["name"] = renamed(volume["configMap"]["name"])
        for source in volume.get("projected", {}).get("sources", []):
            if "configMap" in source:
                source["configMap"]["name"] = renamed(source["configMap"]["name"])
