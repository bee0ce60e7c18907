"""Patch semantics of the API server: JSON merge patch, the strategic-merge subset pods use,
and JSON patch (RFC 6902 add/replace/remove/test).

Strategic merge differs from merge patch only for lists: ``metadata.finalizers`` merges as a
set of strings, and keyed lists (``status.conditions`` by ``type``, containers by ``name``)
merge item by item; ``$patch: delete`` removes a keyed item, ``$patch: replace`` replaces the
map or list, and ``$deleteFromPrimitiveList/<field>`` removes strings from a merged list.
"""

from __future__ import annotations

import copy
from typing import Any

# (parent path, field) → merge key; "" marks a list of primitives merged as a set.
_MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): "",
    ("metadata", "ownerReferences"): "uid",
    ("status", "conditions"): "type",
    ("spec", "containers"): "name",
    ("spec", "initContainers"): "name",
    ("spec", "volumes"): "name",
    ("spec", "tolerations"): "",
    ("status", "podIPs"): "ip",
    ("status", "hostIPs"): "ip",
}


class PatchError(ValueError):
    """A patch that cannot be applied (the server answers 422 or 400)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """The strategic-merge subset described in the module docstring."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    deletions: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions[key.partition("/")[2]] = value if isinstance(value, list) else []
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
            continue
        child = (*path[-1:], key)
        merge_key = _MERGE_KEYS.get(child) if len(path) <= 1 else None
        if merge_key is not None and isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, merge_key)
        else:
            result[key] = strategic_merge_patch(result.get(key), value, (*path, key))
    for key, removed in deletions.items():
        current = result.get(key)
        if isinstance(current, list):
            result[key] = [v for v in current if v not in removed]
    return result


def _merge_list(current: Any, patch: list[Any], merge_key: str) -> list[Any]:
    base = list(current) if isinstance(current, list) else []
    if merge_key == "":
        for item in patch:
            if item not in base:
                base.append(copy.deepcopy(item))
        return base
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(f"map in a merged list lacks the merge key {merge_key!r}")
        index = next(
            (
                i
                for i, e in enumerate(base)
                if isinstance(e, dict) and e.get(merge_key) == item[merge_key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del base[index]
        elif index is None:
            base.append(copy.deepcopy(item))
        else:
            base[index] = strategic_merge_patch(base[index], item)
    return base


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 ``add``, ``replace``, ``remove`` and ``test``."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "path" not in op:
            raise PatchError("each JSON patch operation needs op and path")
        parts = _pointer(str(op["path"]))
        if not parts:
            raise PatchError("patching the document root is not supported")
        parent: Any = doc
        for part in parts[:-1]:
            try:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise PatchError(f"path {op['path']!r} does not exist") from None
        last = parts[-1]
        kind = op.get("op")
        try:
            if kind in ("add", "replace"):
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(op.get("value"))
                    elif kind == "add":
                        parent.insert(int(last), op.get("value"))
                    else:
                        parent[int(last)] = op.get("value")
                else:
                    if kind == "replace" and last not in parent:
                        raise PatchError(f"path {op['path']!r} does not exist")
                    parent[last] = op.get("value")
            elif kind == "remove":
                if isinstance(parent, list):
                    del parent[int(last)]
                else:
                    del parent[last]
            elif kind == "test":
                current = parent[int(last)] if isinstance(parent, list) else parent[last]
                if current != op.get("value"):
                    raise PatchError(f"test failed at {op['path']!r}")
            else:
                raise PatchError(f"unsupported JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"path {op['path']!r} does not exist") from None
    return doc
