"""SkyRL against ``prorsa serve``: configuration keys only, no code change in SkyRL.

SkyRL's ``RemoteInferenceClient`` sends data-plane calls (``/inference/v1/generate`` with
``X-Session-ID``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``/finish_session``) to one proxy URL and fans control calls (``/pause``,
``/resume``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, ``/get_world_size``,
weight routes) out to ``server_urls``. With only ``external_proxy_url`` set, SkyRL uses
that URL for both planes — exactly one prorsa server, whose control calls reach every
engine whatever its role.
"""

from __future__ import annotations

#: The SkyRL config section these keys live in.
SECTION = "generator.inference_engine"


def skyrl_overrides(
    url: str, served_model_name: str, *, enable_prefix_caching: bool = True
) -> dict[str, object]:
    """SkyRL config overrides that point a run at a prorsa server.

    Args:
        url: the server, e.g. ``http://host:8000`` (no ``/v1``).
        served_model_name: the name ``prorsa serve`` answers to (``--served-model-name``,
            default the model folder's name); SkyRL sends it as ``model``.
        enable_prefix_caching: must match the engines (prorsa's are on).
    """
    base = url.rstrip("/").removesuffix("/v1")
    return {
        f"{SECTION}.run_engines_locally": False,
        f"{SECTION}.external_proxy_url": base,
        f"{SECTION}.served_model_name": served_model_name,
        f"{SECTION}.enable_prefix_caching": enable_prefix_caching,
    }


def skyrl_cli_overrides(url: str, served_model_name: str) -> list[str]:
    """The same overrides as Hydra-style command-line arguments."""
    out = []
    for key, value in skyrl_overrides(url, served_model_name).items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"{key}={text}")
    return out
