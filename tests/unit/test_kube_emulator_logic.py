"""Pure parts of the emulator: label selectors and patch semantics."""

from __future__ import annotations

import pytest

from devtools.emulator.patching import PatchError, json_patch, merge_patch, strategic_merge_patch
from devtools.emulator.selectors import SelectorError, compile_selector

LABELS = {"app": "web", "tier": "front", "env": "prod"}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app=db", False),
        ("app!=db", True),
        ("app!=web", False),
        ("missing!=x", True),
        ("env in (prod, staging)", True),
        ("env in (staging)", False),
        ("env notin (prod)", False),
        ("missing notin (prod)", True),
        ("tier", True),
        ("missing", False),
        ("!missing", True),
        ("!tier", False),
        ("app=web,env in (prod,dev),!missing", True),
        ("app=web,env=dev", False),
    ],
)
def test_selector_terms(selector: str, matches: bool) -> None:
    matcher = compile_selector(selector)
    result = True if matcher is None else matcher(LABELS)
    assert result is matches


def test_selector_with_no_labels_matches_only_negative_terms() -> None:
    m = compile_selector("!a,b!=c")
    assert m is not None and m(None) is True
    m = compile_selector("a")
    assert m is not None and m(None) is False


@pytest.mark.parametrize("selector", ["a in b", "a=(b", "=x", "a in (b", "a==b==c"])
def test_bad_selectors_are_rejected(selector: str) -> None:
    with pytest.raises(SelectorError):
        compile_selector(selector)


def test_merge_patch_merges_maps_deletes_nulls_and_replaces_lists() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2], "x": 1}
    assert merge_patch(target, {"a": {"b": None, "d": 3}, "l": [3], "x": None}) == {
        "a": {"c": 2, "d": 3},
        "l": [3],
    }
    assert target == {"a": {"b": 1, "c": 2}, "l": [1, 2], "x": 1}  # not mutated


def test_strategic_merge_patch_merges_conditions_by_type_and_finalizers_as_a_set() -> None:
    pod = {
        "metadata": {"finalizers": ["a"], "labels": {"x": "1"}},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    patched = strategic_merge_patch(
        pod,
        {
            "metadata": {"finalizers": ["a", "b"], "labels": {"y": "2"}},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "PodScheduled", "status": "True"},
                ]
            },
        },
    )
    assert patched["metadata"] == {"finalizers": ["a", "b"], "labels": {"x": "1", "y": "2"}}
    assert patched["status"]["conditions"] == [
        {"type": "Ready", "status": "True"},
        {"type": "PodScheduled", "status": "True"},
    ]
    removed = strategic_merge_patch(
        patched,
        {
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]},
            "status": {"conditions": [{"type": "Ready", "$patch": "delete"}]},
        },
    )
    assert removed["metadata"]["finalizers"] == ["b"]
    assert removed["status"]["conditions"] == [{"type": "PodScheduled", "status": "True"}]


def test_json_patch_operations() -> None:
    doc = {"metadata": {"labels": {"a": "1"}, "finalizers": ["x"]}}
    out = json_patch(
        doc,
        [
            {"op": "test", "path": "/metadata/labels/a", "value": "1"},
            {"op": "add", "path": "/metadata/labels/b", "value": "2"},
            {"op": "remove", "path": "/metadata/finalizers/0"},
            {"op": "replace", "path": "/metadata/labels/a", "value": "3"},
        ],
    )
    assert out == {"metadata": {"labels": {"a": "3", "b": "2"}, "finalizers": []}}
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "test", "path": "/metadata/labels/a", "value": "2"}])
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "remove", "path": "/nope/x"}])
