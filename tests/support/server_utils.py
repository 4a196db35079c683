"""Start and stop `quantfw serve`: subprocesses, or an app in a thread of the test process (to
reach into its engine), on free ports of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
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


class ThreadServer:
    """A FastAPI app under uvicorn in a daemon thread of this process; ``url`` is its base."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.url, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
