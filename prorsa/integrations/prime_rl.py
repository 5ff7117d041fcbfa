"""prime-rl against ``prorsa serve``: orchestrator client configuration only.

prime-rl's orchestrator sends rollouts to ``orchestrator.model.client.base_url`` (OpenAI
``/v1``; its renderer client uses ``/inference/v1/generate``) with ``X-Session-ID`` taken
from the trajectory id, and runs weight updates on every ``admin_base_url``:
``POST /pause?mode=keep&clear_cache=false`` → ``POST /update_weights {"weight_dir"}`` →
``POST /resume``, sending ``Authorization: Bearer $<api_key_var>`` on admin calls and
checking ``GET /health`` and ``GET /v1/models`` at start. A prorsa server answers all of
these; its ``/update_weights`` runs the cross-role protocol (turns frozen by the keep
pause finish under the old weights first, so none is served mixed).
"""

from __future__ import annotations

from typing import Any

SESSION_HEADER = "X-Session-ID"


def prime_rl_client_config(
    url: str, *, api_key_var: str = "PRORSA_ADMIN_TOKEN", skip_model_check: bool = False
) -> dict[str, Any]:
    """``[orchestrator.model.client]`` settings for a prorsa server at ``url``.

    Args:
        url: the server, e.g. ``http://host:8000``.
        api_key_var: environment variable holding the bearer token prime-rl sends; give
            it the value of ``prorsa serve --admin-token`` (prorsa reads the same variable).
        skip_model_check: skip prime-rl's ``/v1/models`` check.
    """
    base = url.rstrip("/").removesuffix("/v1")
    return {
        "base_url": f"{base}/v1",
        "admin_base_url": [base],
        "api_key_var": api_key_var,
        "extra_headers_from_state": {SESSION_HEADER: "trajectory_id"},
        "skip_model_check": skip_model_check,
    }


def prime_rl_toml(url: str, model_name: str, **kwargs: Any) -> str:
    """The client section as TOML text for a prime-rl config file."""
    config = prime_rl_client_config(url, **kwargs)
    lines = ["[orchestrator.model]", f'name = "{model_name}"', "", "[orchestrator.model.client]"]
    lines.append(f'base_url = "{config["base_url"]}"')
    lines.append("admin_base_url = [" + ", ".join(f'"{u}"' for u in config["admin_base_url"]) + "]")
    lines.append(f'api_key_var = "{config["api_key_var"]}"')
    lines.append(f"skip_model_check = {str(config['skip_model_check']).lower()}")
    lines += ["", "[orchestrator.model.client.extra_headers_from_state]"]
    lines += [f'{k} = "{v}"' for k, v in config["extra_headers_from_state"].items()]
    return "\n".join(lines) + "\n"
