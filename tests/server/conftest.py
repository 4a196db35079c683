from __future__ import annotations

import sys

import pytest
from server_utils import free_port, start_server, stop_server
from tiny_checkpoint import build_model

API_KEY = "sk-test-key"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("srv_llama")), "llama")


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """`quantfw serve` on a free port of 127.0.0.1; yields its base URL."""
    port = free_port()
    log = str(tmp_path_factory.mktemp("srv_log") / "server.log")
    cmd = [sys.executable, "-m", "quantfw.entrypoints.cli", "serve", tiny_model]
    cmd += ["--port", str(port), "--api-key", API_KEY, "--served-model-name", "tiny"]
    cmd += ["--max-num-seqs", "8", "--log-level", "warning"]
    proc = start_server(cmd, port, log)
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)
