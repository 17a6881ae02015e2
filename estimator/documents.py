"""Reading JSON and YAML documents without losing a key given twice.

``json.loads`` and ``yaml.safe_load`` keep the last value of a key that appears twice in one
object, so a file that names an app twice, or a port twice, is read as its last value without a
word. The readers of the project's input files (app specs, settings, profiles, catalogs) read
through these instead and refuse such a file in one line naming the key.

>>> loads_json('{"a": 1, "b": {"a": 2}}')
{'a': 1, 'b': {'a': 2}}
>>> loads_json('{"name": "x", "name": "y"}')
Traceback (most recent call last):
...
estimator.documents.DuplicateKeyError: key 'name' appears twice
"""

from __future__ import annotations

import json
from typing import Any

import yaml


class DuplicateKeyError(ValueError):
    """A key given twice in one object (``key``: the key as read)."""

    def __init__(self, key: object) -> None:
        self.key = key
        super().__init__(f"key {key!r} appears twice")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise DuplicateKeyError(key)
        document[key] = value
    return document


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` that raises :class:`DuplicateKeyError` for a key given twice in an object
    (``json.JSONDecodeError`` and ``RecursionError`` as ``json.loads`` does)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice (it would keep the last one silently):
    a ``yaml.constructor.ConstructorError`` whose problem is ``key 'K' appears twice``."""


def _construct_unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: construct_mapping says so
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)
