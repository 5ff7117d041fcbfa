"""Fixtures for the real runtime: one tiny model and one Ray instance per test session.

Engines are expensive (seconds each on 2 cores), so each test module starts its fleet
once (module scope) and its tests share it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a locally trained tokenizer, built once per session."""
    from prorsa.runtime.ray.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance; logical CPUs so several engines share 2 real cores."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=os.environ.get("PRORSA_TEST_ENGINE_LOGS") == "1",
            configure_logging=False,
        )
    yield ray
    if started:
        ray.shutdown()
        _assert_no_leftovers()


def _assert_no_leftovers(timeout_s: float = 15.0) -> None:
    """After shutdown no Ray or vLLM process started by this session may survive."""
    import time

    import psutil

    def leftovers() -> list[str]:
        out = []
        for child in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
                if child.status() != psutil.STATUS_ZOMBIE and ("ray" in cmd or "vllm" in cmd):
                    out.append(f"{child.pid}: {cmd[:120]}")
            except psutil.NoSuchProcess:
                continue
        return out

    deadline = time.monotonic() + timeout_s
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers(), f"processes left after ray.shutdown(): {leftovers()}"
