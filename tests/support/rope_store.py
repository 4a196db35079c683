"""Watching the q/k/v projection's rotary epilogue (`kernels.dense.ops.linear_rope_store`) in
engine tests."""

from __future__ import annotations


def watch_rope_store(monkeypatch, fused: bool) -> list[bool]:
    """Wrap `linear_rope_store` for the rest of the test: with ``fused`` False it declines every
    call (the step projects, then runs the rotary-and-store kernel). Returns the list that
    records, per call, whether the epilogue ran."""
    from quantfw.kernels.dense import ops

    real = getattr(ops.linear_rope_store, "__wrapped__", ops.linear_rope_store)
    served: list[bool] = []

    def watched(*args):
        q = real(*args) if fused else None
        served.append(q is not None)
        return q

    watched.__wrapped__ = real
    monkeypatch.setattr(ops, "linear_rope_store", watched)
    return served
