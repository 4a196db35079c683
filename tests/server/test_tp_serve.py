"""`torchrun --nproc-per-node 2` serving (gloo, CPU) answers with the same greedy tokens as TP=1."""

from __future__ import annotations

import sys

import httpx
import pytest
from server_utils import free_port, start_server, stop_server

from quantfw.engine import LLM, SamplingParams

PROMPTS = ["hello world", "tell me a story about a robot who", "the cat sat on"]


@pytest.mark.slow
def test_tp2_serving_matches_tp1(tiny_model, tmp_path):
    llm = LLM(tiny_model, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    expected_chat = llm.chat([{"role": "user", "content": "hello"}], greedy)[0].outputs[0].text

    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "quantfw.entrypoints.cli", "serve", tiny_model, "--port", str(port)]
    cmd += ["--served-model-name", "tiny", "--max-num-seqs", "4", "--log-level", "warning"]
    proc = start_server(cmd, port, str(tmp_path / "tp2.log"))
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
        bad = httpx.post(f"{url}/completions", json={**body, "model": "nope"}, timeout=60)
        assert bad.status_code == 400
        r = httpx.post(f"{url}/completions", json={**body, "prompt": PROMPTS[0]}, timeout=60)
        assert r.json()["choices"][0]["text"] == expected[0]
    finally:
        stop_server(proc)
