from __future__ import annotations

import pytest
from tiny_checkpoint import build_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3", seed=1)
