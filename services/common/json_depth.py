"""How deeply JSON nests, measured without recursion: every parser of untrusted JSON checks it
before anything that recurses per level (pydantic validation, schema walks) sees the value."""

from __future__ import annotations

from typing import Any

MAX_BODY_DEPTH = 128   # request bodies and batch lines; real ones (tool schemas too) stay far below


def nesting_depth(value: Any, stop_past: int | None = None) -> int:
    """How deeply arrays and objects nest in `value` (a scalar is 0). With `stop_past`, the
    walk ends once a level past it is reached (the value is too deep either way)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = (node.values() if isinstance(node, dict)
                    else node if isinstance(node, list) else None)
        if children is None:
            continue
        deepest = max(deepest, depth)
        if stop_past is not None and depth > stop_past:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest
