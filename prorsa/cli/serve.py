"""``prorsa serve``: a long-lived rollout service over HTTP for RL trainers.

Options and their help come from :class:`~prorsa.serve.config.ServeConfig`.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from prorsa.cli.common import console, friendly_errors
from prorsa.cli.simulate import parse_params
from prorsa.serve.config import ServeConfig

_HELP = ServeConfig.help()


def _opt(default: object, name: str, *flags: str) -> object:
    return typer.Option(default, *flags, help=_HELP[name])


@friendly_errors
def serve_cmd(
    model: Path = _opt(..., "model", "--model"),
    engines: int = _opt(2, "engines", "--engines"),
    policy: str = _opt("colocate", "policy", "--policy"),
    policy_param: list[str] = _opt([], "policy_params", "--param"),
    forecaster: str | None = _opt(None, "forecaster", "--forecaster"),
    host: str = _opt("127.0.0.1", "host", "--host"),
    port: int = _opt(8000, "port", "--port"),
    admin_token: str | None = typer.Option(
        None,
        "--admin-token",
        envvar="PRORSA_ADMIN_TOKEN",
        help=_HELP["admin_token"] + " Also read from PRORSA_ADMIN_TOKEN.",
    ),
    served_model_name: str | None = _opt(None, "served_model_name", "--served-model-name"),
    max_model_len: int = _opt(1024, "max_model_len", "--max-model-len"),
    max_num_seqs: int = _opt(16, "max_num_seqs", "--max-num-seqs"),
    kv_cache_gib: float | None = _opt(None, "kv_cache_gib", "--kv-cache-gib"),
    connector: str = _opt("auto", "connector", "--connector"),
    interval_s: float = _opt(0.5, "interval_s", "--interval-s"),
    min_dwell_s: float = _opt(5.0, "min_dwell_s", "--min-dwell-s"),
    drain_timeout_s: float = _opt(5.0, "drain_timeout_s", "--drain-timeout-s"),
    local_prefill_threshold: int = _opt(0, "local_prefill_threshold", "--local-prefill-threshold"),
    sync_drain_timeout_s: float = _opt(60.0, "sync_drain_timeout_s", "--sync-drain-timeout-s"),
    engine_control_timeout_s: float = _opt(
        30.0, "engine_control_timeout_s", "--engine-control-timeout-s"
    ),
    engine_stall_timeout_s: float = _opt(
        120.0, "engine_stall_timeout_s", "--engine-stall-timeout-s"
    ),
    kv_wait_timeout_s: float = _opt(60.0, "kv_wait_timeout_s", "--kv-wait-timeout-s"),
    session_idle_s: float = _opt(900.0, "session_idle_s", "--session-idle-s"),
    stream_legs: bool = _opt(False, "stream_legs", "--stream-legs/--no-stream-legs"),
    telemetry_dir: Path | None = _opt(None, "telemetry_dir", "--telemetry-dir"),
    profile: str | None = _opt(None, "profile", "--profile"),
    ray_address: str | None = _opt(None, "ray_address", "--ray-address"),
    worker_extension_cls: str | None = _opt(None, "worker_extension_cls", "--worker-extension-cls"),
    tool_call_parser: str | None = _opt(None, "tool_call_parser", "--tool-call-parser"),
    workload_scenario: str | None = _opt(None, "workload_scenario", "--workload-scenario"),
    seed: int = _opt(0, "seed", "--seed"),
) -> None:
    """Serve SkyRL, prime-rl, AReaL, verl and OpenAI clients from one set of engines.

    Token-in/token-out /inference/v1/generate, OpenAI /v1/completions and
    /v1/chat/completions, the trainers' pause/resume/sleep/weight-update routes, /health
    and /metrics. Stops engines and Ray on Ctrl-C or SIGTERM.
    """
    from prorsa.serve.server import serve

    config = ServeConfig(
        model=str(model.expanduser().resolve()),
        engines=engines,
        policy=policy,
        policy_params=parse_params(policy_param),
        forecaster=forecaster,
        served_model_name=served_model_name,
        host=host,
        port=port,
        admin_token=admin_token,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_gib=kv_cache_gib,
        connector=connector,
        interval_s=interval_s,
        min_dwell_s=min_dwell_s,
        drain_timeout_s=drain_timeout_s,
        local_prefill_threshold=local_prefill_threshold,
        sync_drain_timeout_s=sync_drain_timeout_s,
        engine_control_timeout_s=engine_control_timeout_s,
        engine_stall_timeout_s=engine_stall_timeout_s,
        kv_wait_timeout_s=kv_wait_timeout_s,
        session_idle_s=session_idle_s,
        stream_legs=stream_legs,
        telemetry_dir=str(telemetry_dir) if telemetry_dir else None,
        profile=profile,
        ray_address=ray_address,
        worker_extension_cls=worker_extension_cls,
        tool_call_parser=tool_call_parser,
        workload_scenario=workload_scenario,
        seed=seed,
    )
    config.validate()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console.print(
        f"starting {engines} engines ({policy}) for {config.model_name} ...", highlight=False
    )

    def ready(service: object) -> None:
        auth = "admin routes open"
        if admin_token:
            # Named: a token left in the environment would lock out clients that send
            # none (AReaL) without anyone having passed --admin-token.
            source = (
                "PRORSA_ADMIN_TOKEN"
                if os.environ.get("PRORSA_ADMIN_TOKEN") == admin_token
                else "--admin-token"
            )
            auth = f"admin routes need the bearer token from {source}"
        console.print(
            f"serving {config.model_name} on http://{host}:{port} ({auth}); Ctrl-C stops",
            highlight=False,
        )

    def stopping() -> None:
        console.print("stopping: shutting down engines and Ray ...", highlight=False)

    serve(config, on_ready=ready, on_stopping=stopping)
    console.print("stopped: engines and Ray shut down", highlight=False)
