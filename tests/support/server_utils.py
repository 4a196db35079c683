"""Start and stop `quantfw serve` subprocesses on free ports of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"server at {url} did not become healthy in {timeout}s")


def start_server(cmd: list[str], port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115  (closed when the process is stopped)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    except Exception as e:
        stop_server(proc)
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"server failed to start; log:\n{tail}") from e
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
