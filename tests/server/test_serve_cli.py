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
