"""`torchrun --nproc-per-node 2` serving (gloo, CPU): the same greedy tokens as TP=1, and a rank
that dies ends the whole job with a message within seconds."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from server_utils import free_port, start_server, stop_server  # noqa: E402

from quantfw.engine import LLM, SamplingParams  # noqa: E402

PROMPTS = ["hello world", "tell me a story about a robot who", "the cat sat on"]
#: how long the job may take to end after a rank died
DEATH_TO_EXIT_S = 20


def rank_pid(launcher_pid: int, rank: int) -> int:
    """The pid of the torchrun worker with this RANK (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(entry)
    raise LookupError(f"no child of {launcher_pid} has RANK={rank}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds ranks through /proc")
def test_tp2_serves_like_tp1_and_a_dead_rank_ends_the_job(tiny_model, tmp_path):
    llm = LLM(tiny_model, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    expected_chat = llm.chat([{"role": "user", "content": "hello"}], greedy)[0].outputs[0].text

    port = free_port()
    log = tmp_path / "tp2.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "quantfw.entrypoints.cli", "serve", tiny_model, "--port", str(port)]
    cmd += ["--served-model-name", "tiny", "--max-num-seqs", "4", "--log-level", "warning"]
    proc = start_server(cmd, port, str(log))
    try:
        url = f"http://127.0.0.1:{port}/v1"
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == expected
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = httpx.post(f"{url}/chat/completions", json=chat, timeout=60)
        assert r.json()["choices"][0]["message"]["content"] == expected_chat
        bad = httpx.post(f"{url}/completions", json={**body, "prompt": "dog " * 400}, timeout=60)
        assert bad.status_code == 400

        # a worker rank dies in the middle of a stream: the job ends, fast, saying why
        long = {**body, "prompt": PROMPTS[0], "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
            died = time.monotonic()
            try:
                for _ in lines:
                    pass
            except httpx.HTTPError:
                pass  # the server went away mid-stream
        proc.wait(timeout=DEATH_TO_EXIT_S + 30)
        took = time.monotonic() - died
        text = log.read_text()
        print(f"job ended {took:.1f} s after the rank died")
        assert proc.returncode != 0
        assert took < DEATH_TO_EXIT_S, f"the job took {took:.1f} s to end; log:\n{text[-3000:]}"
        assert "rank      : 1" in text and "SIGKILL" in text, text[-3000:]
    finally:
        stop_server(proc)
