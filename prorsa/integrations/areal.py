"""AReaL against ``prorsa serve``: one server address.

AReaL's ``RemoteInfEngine`` (vLLM backend) takes server addresses as ``host:port`` —
``engine.initialize(addr=...)`` or the ``AREAL_LLM_SERVER_ADDRS`` environment variable —
and sends: ``POST /v1/completions`` with token-id prompts, ``logprobs: 0`` and
``return_tokens_as_token_ids`` (parsing ``"token_id:N"``), ``GET /health``, and for a
weight update from disk ``POST /areal_pause_generation`` → ``POST /areal_update_weights
{"model_path"}`` → ``POST /areal_continue_generation``. AReaL sends no bearer token, so
run ``prorsa serve`` without ``--admin-token`` for it (or behind a private network).
"""

from __future__ import annotations

from urllib.parse import urlparse

ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"


def areal_server_addr(url: str) -> str:
    """``host:port`` of a prorsa server, the form AReaL expects."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"need a host and a port in {url!r}, e.g. http://127.0.0.1:8000")
    return f"{parsed.hostname}:{parsed.port}"


def areal_environment(url: str) -> dict[str, str]:
    """Environment for an AReaL trainer process that should use this server."""
    return {ADDRS_ENV: areal_server_addr(url)}
