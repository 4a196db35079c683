"""`quantfw serve` argument errors, before any server starts."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")

from quantfw.entrypoints.cli import main  # noqa: E402


@pytest.mark.parametrize("name", ["missing-folder/sub/dir", "./not-here"])
def test_model_neither_folder_nor_hub_id(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert main(["serve", name]) == 1
    err = capsys.readouterr().err
    assert f"{name!r}: it is neither an existing folder nor a valid Hugging Face repo id" in err


def test_negative_queue_bound(tiny_model, capsys):
    assert main(["serve", tiny_model, "--max-queued-requests", "-1"]) == 1
    assert "--max-queued-requests=-1 must be >= 0" in capsys.readouterr().err


def test_a_worker_rank_leaves_quietly_on_ctrl_c(capsys):
    """torchrun passes Ctrl-C to every rank: a worker blocked in its loop exits with 130 and
    no traceback (seen on two H100s, 2026-11-27: rank 1 printed a KeyboardInterrupt's)."""
    from types import SimpleNamespace

    from quantfw.entrypoints.cmd_serve import _run_worker

    def interrupted() -> None:
        raise KeyboardInterrupt

    engine = SimpleNamespace(runner=SimpleNamespace(worker_loop=interrupted))
    try:
        code = _run_worker(engine)
    except KeyboardInterrupt:
        pytest.fail("the worker let Ctrl-C out as a KeyboardInterrupt")
    assert code == 130
    assert capsys.readouterr().err == ""
