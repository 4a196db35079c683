"""Whether kernel calls are being made for CUDA graphs (their warm-up and capture) or eagerly.

A graph replays its launches without the host, so a kernel that costs more host time per call
(several launches, TMA descriptors, many arguments) but less GPU time wins there and can lose
eagerly, where short prefills are bound by the host's launch rate. The engine's decode graphs
are warmed up and captured inside `graph_launches`; dispatchers read `graph_launches_active`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_STATE = threading.local()


@contextmanager
def graph_launches() -> Iterator[None]:
    """Mark the calls made inside as launches for CUDA graphs (nests)."""
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def graph_launches_active() -> bool:
    """True inside `graph_launches` on this thread."""
    return getattr(_STATE, "depth", 0) > 0
