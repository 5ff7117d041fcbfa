"""What ``prorsa serve`` adds over calling an engine directly, at 1, 16 and 64 sessions.

One tiny-model engine in Ray, reached three ways in alternating rounds:

* direct: ``EngineServer.generate`` through its Ray actor handle from this process;
* served: ``POST /inference/v1/generate`` to ``prorsa serve`` (router, sessions, admission,
  telemetry, HTTP) over the same engine, from a separate client process (as a trainer
  would be), each session a multi-turn conversation with ``X-Session-ID``;
* floor: the same client and route against a bare ASGI app on the same uvicorn settings
  and event loop that forwards each body straight to the engine actor. It is what any
  HTTP hop in front of the engine costs on this machine (client, uvicorn, JSON), so
  *served minus floor* is prorsa's own share.

Per request, *overhead* is the client-observed latency minus the time the request spent
inside the engine actor (which all paths report), so engine queueing and decode time cancel
out; *added* is overhead minus direct overhead (the Ray round trip), at p50 and p99.
Requests/s is requests completed per second of each phase; server CPU per turn is this
process's CPU time (the server thread and Ray's driver threads) over a phase's turns.
The same is measured once more at 16 sessions with 800-token prompts (``long_prompt``),
where the server's per-token work shows. Writes benchmarks/results/serve.json. Goal from
issue 12: added p50 < 3 ms and p99 < 20 ms at 16 sessions.

    .venv/bin/python benchmarks/serve_bench.py [--requests 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks._common import CollectionTimer, save

CONCURRENCY = (1, 16, 64)
PROMPT_TOKENS = 32
#: A second, trainer-like context length at 16 sessions: the server's per-token work
#: (decoding and checking the body, the router's prompt check, Ray serialisation) shows.
LONG_PROMPT_TOKENS = 800
MAX_TOKENS = 4


def prompt_for(session: int, turn: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    return [(31 * session + 7 * i + turn) % 500 + 3 for i in range(tokens + 2 * turn)]


# ---------------------------------------------------------------------- client process
async def client_load(
    url: str,
    concurrency: int,
    requests: int,
    http_client: str = "aiohttp",
    prompt_tokens: int = PROMPT_TOKENS,
) -> list[tuple[float, float]]:
    """(latency_s, engine_s) per request, ``concurrency`` sessions of ``requests`` turns."""
    out: list[tuple[float, float]] = []
    async with _http_session(url, concurrency, http_client) as post:

        async def session(s: int) -> None:
            sid = f"bench-{concurrency}-{s}-{time.monotonic_ns()}"
            for turn in range(requests):
                body = {"token_ids": prompt_for(s, turn, prompt_tokens),
                        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                            "ignore_eos": True}}  # fmt: skip
                started = time.perf_counter()
                reply = await post("/inference/v1/generate", body, {"X-Session-ID": sid})
                out.append((time.perf_counter() - started, reply["prorsa"]["engine_s"]))
            await post(f"/finish_session?session_id={sid}", None, {})

        await asyncio.gather(*(session(s) for s in range(concurrency)))
    return out


@contextlib.asynccontextmanager
async def _http_session(url: str, concurrency: int, http_client: str):
    """``post(path, json, headers) -> reply`` over a pooled client of either library.

    aiohttp by default: httpx's pool costs the *client* several ms of CPU per request at
    64 connections (measured here: ~7 ms), which on two shared cores starves the server and
    would be charged to it; SkyRL's and AReaL's clients use aiohttp too.
    """
    if http_client == "httpx":
        import httpx

        limits = httpx.Limits(
            max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
        )
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

            async def post(path: str, body: Any, headers: dict[str, str]) -> Any:
                r = await http.post(path, json=body, headers=headers)
                r.raise_for_status()
                return r.json()

            yield post
        return
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

        async def post(path: str, body: Any, headers: dict[str, str]) -> Any:
            async with http.post(path, json=body, headers=headers) as r:
                r.raise_for_status()
                return await r.json()

        yield post


def served_round(
    url: str,
    concurrency: int,
    requests: int,
    http_client: str = "aiohttp",
    prompt_tokens: int = PROMPT_TOKENS,
) -> tuple[list, float, float]:
    """(samples, wall_s, server_cpu_s): one client process against ``url``."""
    cmd = [sys.executable, __file__, "--client", url, "--concurrency", str(concurrency),
           "--requests", str(requests), "--http-client", http_client,
           "--prompt-tokens", str(prompt_tokens)]  # fmt: skip
    started, cpu = time.perf_counter(), time.process_time()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    payload = json.loads(done.stdout.strip().splitlines()[-1])
    return payload["samples"], payload["wall_s"] or wall, cpu


# ---------------------------------------------------------------------- HTTP floor
def floor_app(client: Any):
    """A bare ASGI app: decode, one engine call, encode; nothing prorsa does per turn."""
    import itertools

    import msgspec

    ids = itertools.count()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        reply: dict[str, Any] = {}
        if scope["path"] == "/inference/v1/generate":
            body = msgspec.json.decode(b"".join(chunks))
            result = await client.generate(
                f"floor-{next(ids)}", body["token_ids"], body["sampling_params"]["max_tokens"],
                0.0, ignore_eos=True,
            )  # fmt: skip
            reply = {
                "choices": [{"token_ids": result["output_token_ids"]}],
                "prorsa": {"engine_s": result["timings"]["total_s"]},
            }
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": msgspec.json.encode(reply)})

    return app


@contextlib.contextmanager
def floor_server(client: Any, config: Any):
    """:func:`floor_app` on a thread, with ``prorsa serve``'s uvicorn settings and loop."""
    import threading

    import uvicorn

    from prorsa.serve.server import event_loop_factory, listen_socket, uvicorn_config

    sock = listen_socket(config.host, config.port)
    server = uvicorn.Server(uvicorn_config(config, floor_app(client)))

    def run() -> None:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, name="http-floor", daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# ---------------------------------------------------------------------- direct path
async def direct_load(
    client, concurrency: int, requests: int, prompt_tokens: int = PROMPT_TOKENS
) -> tuple[list, float]:
    out: list[tuple[float, float]] = []

    async def session(s: int) -> None:
        for turn in range(requests):
            started = time.perf_counter()
            request_id = f"d{concurrency}-{s}-{turn}-{time.monotonic_ns()}"
            r = await client.generate(
                request_id, prompt_for(s, turn, prompt_tokens), MAX_TOKENS, 0.0, ignore_eos=True
            )
            out.append((time.perf_counter() - started, r["timings"]["total_s"]))

    started = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(concurrency)))
    return out, time.perf_counter() - started


def stats(
    samples: list[tuple[float, float]], wall_s: float, cpu_s: float | None = None
) -> dict[str, float]:
    latency = np.array([s[0] for s in samples])
    overhead = np.array([s[0] - s[1] for s in samples])
    return {
        "requests": len(samples),
        "requests_per_s": len(samples) / wall_s,
        **({} if cpu_s is None else {"server_cpu_ms_per_turn": cpu_s / len(samples) * 1000}),
        "latency_p50_ms": float(np.percentile(latency, 50) * 1000),
        "latency_p99_ms": float(np.percentile(latency, 99) * 1000),
        "overhead_p50_ms": float(np.percentile(overhead, 50) * 1000),
        "overhead_p99_ms": float(np.percentile(overhead, 99) * 1000),
    }


def measure(
    client: Any,
    urls: dict[str, str],
    concurrency: int,
    requests: int,
    args: Any,
    prompt_tokens: int = PROMPT_TOKENS,
) -> dict[str, Any]:
    """Direct and each HTTP path in alternating rounds; added latency of each path."""
    samples: dict[str, list] = {"direct": [], **{name: [] for name in urls}}
    wall = dict.fromkeys(samples, 0.0)
    cpu = dict.fromkeys(urls, 0.0)
    # The servers run on threads of this process: a collection here pauses them.
    collections = CollectionTimer()
    try:
        for _ in range(args.rounds):
            collections.phase = "direct"
            d, w = asyncio.run(direct_load(client, concurrency, requests, prompt_tokens))
            samples["direct"] += d
            wall["direct"] += w
            for name, url in urls.items():
                collections.phase = name
                s, w, c = served_round(url, concurrency, requests, args.http_client, prompt_tokens)
                samples[name] += s
                wall[name] += w
                cpu[name] += c
    finally:
        collections.close()
    row: dict[str, Any] = {"direct": stats(samples["direct"], wall["direct"])}
    for name in urls:
        row[name] = {**stats(samples[name], wall[name], cpu[name]),
                     "gc": collections.summary(name)}  # fmt: skip
    direct = row["direct"]
    for name in urls:
        prefix = "" if name == "served" else f"{name}_"
        row[f"{prefix}added_p50_ms"] = row[name]["overhead_p50_ms"] - direct["overhead_p50_ms"]
        row[f"{prefix}added_p99_ms"] = row[name]["overhead_p99_ms"] - direct["overhead_p99_ms"]
    served, floor = row["served"], row.get("floor")
    line = (
        f"{concurrency:>3} sessions, {prompt_tokens}-token prompts: served "
        f"{served['requests_per_s']:.0f} req/s vs direct "
        f"{direct['requests_per_s']:.0f}; added p50 {row['added_p50_ms']:.2f} ms, "
        f"p99 {row['added_p99_ms']:.2f} ms; server CPU {served['server_cpu_ms_per_turn']:.2f} "
        "ms/turn"
    )
    if floor is not None:
        line += (
            f" | HTTP floor: added p50 {row['floor_added_p50_ms']:.2f} ms, "
            f"p99 {row['floor_added_p99_ms']:.2f} ms, CPU "
            f"{floor['server_cpu_ms_per_turn']:.2f} ms/turn"
        )
    print(line, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="turns per session per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as load client
    parser.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help=argparse.SUPPRESS)
    parser.add_argument("--http-client", choices=("aiohttp", "httpx"), default="aiohttp",
                        help="the load client's HTTP library")  # fmt: skip
    parser.add_argument("--unfrozen", action="store_true",
                        help="serve with the server's and the engine's start-up heaps left "
                        "in the collector's full passes, to compare "
                        "(writes serve-unfrozen.json)")  # fmt: skip
    args = parser.parse_args()
    if args.client:
        started = time.perf_counter()
        load = client_load(
            args.client, args.concurrency, args.requests, args.http_client, args.prompt_tokens
        )
        samples = asyncio.run(load)
        print(json.dumps({"samples": samples, "wall_s": time.perf_counter() - started}))
        return

    import ray

    from prorsa.runtime.ray.cluster import EngineFleet, FleetSpec
    from prorsa.runtime.ray.config import EngineConfig
    from prorsa.runtime.ray.engine import free_port
    from prorsa.runtime.ray.tiny_model import make_tiny_model
    from prorsa.serve import ServeConfig
    from prorsa.serve.server import BackgroundServer

    rows: dict[str, dict] = {}
    long_rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        engine = EngineConfig(model=str(model), dtype="float32", max_model_len=1024,
                              max_num_seqs=64, kv_cache_gib=0.25, connector=None,
                              freeze_startup_heap=not args.unfrozen)  # fmt: skip
        fleet = EngineFleet.start(FleetSpec(engine, roles=["colocated"]))
        config = ServeConfig(model=str(model), engines=1, policy="colocate", port=free_port(),
                             max_num_seqs=64, freeze_startup_heap=not args.unfrozen)  # fmt: skip
        floor_config = ServeConfig(model=str(model), engines=1, port=free_port())
        client = fleet.clients[0]
        try:
            with (
                BackgroundServer(config, fleet=fleet) as server,
                floor_server(client, floor_config) as floor_url,
            ):
                # warm-up: connections, NIXL-free path, caches
                served_round(server.url, 4, 5, args.http_client)
                served_round(floor_url, 4, 5, args.http_client)
                asyncio.run(direct_load(client, 4, 5))
                for c in CONCURRENCY:
                    requests = max(5, args.requests // max(1, c // 8))
                    rows[str(c)] = measure(
                        client, {"served": server.url, "floor": floor_url}, c, requests, args
                    )
                long_rows["16"] = measure(
                    client, {"served": server.url, "floor": floor_url}, 16, args.requests // 2,
                    args, LONG_PROMPT_TOKENS,
                )  # fmt: skip
        finally:
            fleet.shutdown()
            ray.shutdown()
    path = save(
        "serve-unfrozen" if args.unfrozen else "serve",
        {
            "setup": {
                "engines": 1,
                "prompt_tokens": PROMPT_TOKENS,
                "max_tokens": MAX_TOKENS,
                "rounds": args.rounds,
                "http_client": args.http_client,
                "freeze_startup_heap": config.freeze_startup_heap,
                "load_average": os.getloadavg(),
            },
            "goal": {"concurrency": 16, "added_p50_ms": 3.0, "added_p99_ms": 20.0},
            "floor": "a bare ASGI app on the same uvicorn settings and loop, forwarding each "
            "body to the engine actor: what any HTTP hop costs here",
            "concurrency": rows,
            "long_prompt": {"prompt_tokens": LONG_PROMPT_TOKENS, "concurrency": long_rows},
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
