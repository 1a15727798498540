"""Nested structures of tensors: walking their leaves, rebuilding them, naming a leaf by its path.

A structure is a tensor or any nesting of mappings, lists, tuples, namedtuples and dataclass
instances around tensors and other values. A leaf's path is a tuple of :data:`PathElem`, rendered
for messages as ``output['logits'][1]`` (Python style) or ``optimizer.state.3.exp_avg``
(state_dict style).

Example::

    for path, leaf in leaves({"logits": out, "aux": [a, b]}):
        print(render_path("output", path), leaf.shape)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "PathElem",
    "TreePath",
    "children",
    "is_dataclass_instance",
    "is_namedtuple",
    "leaves",
    "map_tensors",
    "render_path",
    "unravel_index",
]

#: A path element into a nested structure: ("item", key) for mappings, ("index", i) for lists and
#: tuples, ("attr", name) for namedtuple and dataclass fields.
PathElem = tuple[str, Any]
#: The path from the root of a nested structure to one of its leaves.
TreePath = tuple[PathElem, ...]


def is_namedtuple(value: object) -> bool:
    """Whether ``value`` is a namedtuple instance (a tuple with ``_fields``)."""
    return isinstance(value, tuple) and hasattr(value, "_fields")


def is_dataclass_instance(value: object) -> bool:
    """Whether ``value`` is an instance of a dataclass (not the class itself)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def children(value: Any) -> list[tuple[PathElem, Any]] | None:
    """The children of a container (with their path elements), or None for a leaf."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, Mapping):
        return [(("item", key), child) for key, child in value.items()]
    if is_namedtuple(value):
        return [(("attr", key), getattr(value, key)) for key in value._fields]
    if is_dataclass_instance(value):
        return [(("attr", f.name), getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [(("index", i), child) for i, child in enumerate(value)]
    return None


def leaves(value: Any, path: TreePath = ()) -> Iterator[tuple[TreePath, Any]]:
    """Every leaf of ``value`` (tensors and non-container values) with its path, depth first."""
    kids = children(value)
    if kids is None:
        yield path, value
        return
    for elem, child in kids:
        yield from leaves(child, (*path, elem))


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild a nested structure with every tensor replaced by ``fn(tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        items = {key: map_tensors(child, fn) for key, child in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if is_namedtuple(value):
        return type(value)(*(map_tensors(child, fn) for child in value))
    if is_dataclass_instance(value):
        changes = {
            f.name: map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(child, fn) for child in value)
    return value


def render_path(name: str, path: TreePath, *, dotted: bool = False) -> str:
    """``name['logits'][1]`` (Python style), or ``name.logits.1`` (state_dict style)."""
    parts = [name]
    for kind, key in path:
        if kind == "attr" or dotted:
            parts.append(f".{key}")
        elif kind == "item":
            parts.append(f"[{key!r}]")
        else:
            parts.append(f"[{key}]")
    return "".join(parts)


def unravel_index(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The multi-dimensional index of element ``flat_index`` of a row-major tensor of ``shape``."""
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))
