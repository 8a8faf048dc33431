"""Work on many hosts at once from the control machine: each item in a thread of its own (the work waits on
the network), the results in the items' order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def parallel(items: Sequence[T], work: Callable[[T], R], workers: int | None = None) -> list[R]:
    """work(item) for every item at once (threads; the work is network-bound), results in order."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=workers or min(32, len(items))) as pool:
        return list(pool.map(work, items))
