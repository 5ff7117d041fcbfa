"""``prorsa serve`` as a process: it serves, then SIGTERM stops engines and Ray cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prorsa.runtime.ray.engine import free_port

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def test_sigterm_shuts_down_engines_and_ray(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    port = free_port()
    cmd = [sys.executable, "-m", "prorsa.cli.main", "serve", "--model", str(tiny_model_dir),
           "--engines", "1", "--port", str(port), "--admin-token", "t0ken",
           "--kv-cache-gib", "0.125", "--telemetry-dir", str(tmp_path / "tel")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # The server's output goes to a file, not a pipe: vLLM and Ray log enough to fill a pipe's
    # buffer, and a server blocked on a full pipe never becomes healthy.
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 -- closed in the finally below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)
        body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 3, "logprobs": 0}}
        # a generous timeout: the first request on a loaded 2-core machine takes seconds
        r = httpx.post(
            f"{url}/inference/v1/generate", json=body, headers={"X-Session-ID": "a"}, timeout=120
        )
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
        assert httpx.post(f"{url}/pause", timeout=60).status_code == 401
        children = _tree(proc.pid)
        assert len(children) >= 3  # Ray's processes and the engine actor at least
        proc.send_signal(signal.SIGTERM)
        # Signals during the clean-up (a second Ctrl-C, a supervisor's repeated SIGTERM)
        # must not cut it short.
        deadline = time.monotonic() + 60
        while "stopping: shutting down" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        resignalled = proc.poll() is None
        if resignalled:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = log_path.read_text()
    assert code == 0, output
    assert "stopped: engines and Ray shut down" in output
    assert not resignalled or "while shutting down" in output
    deadline = time.monotonic() + 30
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(children) == [], "processes left behind"
    assert any((tmp_path / "tel").iterdir())  # telemetry flushed on the way out
