"""GRPO on the tiny model, end to end on CPU, with ``prorsa serve`` doing the rollouts.

Each step: 2 prompts x 8 samples, each a two-turn trajectory — the model writes 8 tokens,
a real local tool (prorsa's sandboxed Python evaluator) counts how many of them fall in a
target range, its answer is appended as an observation, the model writes 8 more. The
reward is the share of written tokens in the target range. The trainer (plain torch on the
same Llama) computes the GRPO loss from the engines' logprobs (the "old" policy of the
clipped ratio), saves the new weights with ``save_pretrained``, and posts them to
``/update_weights``; the server loads them on every engine, whatever its role. During each
step the three engines rotate roles live (prefill -> colocated, decode -> prefill,
colocated -> decode) while trajectories are in flight.

After each update the example checks every engine in its current role against the
trainer's own forward pass: greedy tokens and logprobs of a fixed prompt (prompt logprobs
from the prefill engine of a forced disaggregated turn, output logprobs from its decode
engine, and a colocated turn), and that they changed since the previous version.

    python examples/grpo_tiny.py --steps 4 --out out/grpo

Run against an already running server with ``--url`` (it must serve a 3-engine fleet of
the same model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGET_LOW, TARGET_HIGH = 256, 320  # the reward's token range
FIXED_PROMPT = [1, 88, 319, 29, 224, 75, 76, 2, 1, 305, 86, 381, 414, 87, 29, 224]
LOGPROB_ATOL = 2e-3  # engine vs trainer, float32 on both sides
ROTATION = {"prefill": "colocated", "decode": "prefill", "colocated": "decode"}


@dataclass
class GRPOConfig:
    """One small GRPO run."""

    steps: int = 4
    prompts: int = 2
    group_size: int = 8
    tokens_per_turn: int = 8
    lr: float = 2e-2
    epochs: int = 2
    clip: float = 0.2
    seed: int = 0


@dataclass
class Trajectory:
    session: str
    group: int
    tokens: list[int]  # prompt, turns and observations, in order
    generated: list[bool]  # which of ``tokens`` the model wrote
    engine_logprobs: list[float]  # per generated token, as the engines sampled them
    reward: float = 0.0
    versions: set[int] = field(default_factory=set)
    paths: list[str] = field(default_factory=list)


class Server:
    """The HTTP calls the trainer makes."""

    def __init__(self, url: str, token: str | None = None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=url, timeout=600, headers=headers)

    async def generate(self, session: str, ids: list[int], sampling: dict, routing=None) -> dict:
        body = {"token_ids": ids, "sampling_params": sampling}
        if routing:
            body["routing"] = routing
        r = await self.http.post(
            "/inference/v1/generate", json=body, headers={"X-Session-ID": session}
        )
        r.raise_for_status()
        return r.json()

    async def post(self, path: str, **kwargs: Any) -> dict:
        r = await self.http.post(path, **kwargs)
        r.raise_for_status()
        return r.json()

    async def roles(self) -> dict[int, str]:
        status = (await self.http.get("/prorsa/status")).json()
        return {int(k): v for k, v in status["roles"].items()}


async def run_trajectory(server: Server, tool: Any, tokenizer: Any, session: str, group: int,
                         prompt: list[int], cfg: GRPOConfig, seed: int) -> Trajectory:  # fmt: skip
    traj = Trajectory(session, group, list(prompt), [False] * len(prompt), [])
    for turn in range(2):
        sampling = {"max_tokens": cfg.tokens_per_turn, "temperature": 1.0, "logprobs": 0,
                    "seed": seed + turn, "ignore_eos": True}  # fmt: skip
        out = await server.generate(session, traj.tokens, sampling)
        choice = out["choices"][0]
        traj.tokens += choice["token_ids"]
        traj.generated += [True] * len(choice["token_ids"])
        traj.engine_logprobs += [e["logprob"] for e in choice["logprobs"]["content"]]
        traj.versions.add(out["prorsa"]["weight_version"])
        traj.paths.append(out["prorsa"]["path"])
        if turn == 0:  # the tool runs between the turns
            written = choice["token_ids"]
            result = await tool.call(
                {"expression": f"sum(1 for t in {written} if {TARGET_LOW} <= t < {TARGET_HIGH})"}
            )
            observation = tokenizer.encode(f" Observation: {result.text.strip()}.")
            traj.tokens += observation
            traj.generated += [False] * len(observation)
    await server.post("/finish_session", params={"session_id": session})
    written = [t for t, g in zip(traj.tokens, traj.generated, strict=True) if g]
    traj.reward = sum(TARGET_LOW <= t < TARGET_HIGH for t in written) / len(written)
    return traj


async def rotate_roles(server: Server) -> list[dict]:
    """Every engine to its next role, one live switch at a time (the order keeps a
    decode-side engine at every moment)."""
    roles = await server.roles()
    order = [r for r in ("prefill", "decode", "colocated") if r in roles.values()]
    done = []
    for role in order:
        engine = next(e for e, r in roles.items() if r == role)
        done.append(
            await server.post(
                "/prorsa/switch_role", json={"engine_id": engine, "role": ROTATION[role]}
            )
        )
    return done


def token_logprobs(model: Any, sequence: list[int]) -> Any:
    """log p(token_i | tokens_<i) for i >= 1, and the full log-softmax rows."""
    import torch

    x = torch.tensor([sequence])
    rows = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
    return rows.gather(1, x[0, 1:, None])[:, 0], rows


def grpo_update(model: Any, optimizer: Any, trajs: list[Trajectory], cfg: GRPOConfig) -> dict:
    """Clipped GRPO on the written tokens; old logprobs are the engines'."""
    import torch

    rewards = torch.tensor([t.reward for t in trajs]).view(cfg.prompts, cfg.group_size)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    masks = [torch.tensor(t.generated[1:], dtype=torch.bool) for t in trajs]
    old = [torch.tensor(t.engine_logprobs) for t in trajs]
    max_diff = 0.0
    for epoch in range(cfg.epochs):
        loss = torch.zeros(())
        for traj, adv, mask, old_lp in zip(trajs, advantages.view(-1), masks, old, strict=True):
            new_lp = token_logprobs(model, traj.tokens)[0][mask]
            if epoch == 0:  # same weights: the trainer must see what the engines sampled from
                max_diff = max(max_diff, float((new_lp.detach() - old_lp).abs().max()))
            ratio = torch.exp(new_lp - old_lp)
            clipped = torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip)
            loss = loss - torch.minimum(ratio * adv, clipped * adv).mean()
        optimizer.zero_grad()
        (loss / len(trajs)).backward()
        optimizer.step()
    return {"max_logprob_diff_engine_vs_trainer": max_diff}


async def check_engines(server: Server, model: Any, version: int, previous: dict) -> list[dict]:
    """Greedy tokens and logprobs of FIXED_PROMPT from every engine in its role vs the trainer."""
    import torch

    roles = await server.roles()
    by_role = {r: e for e, r in roles.items()}
    sampling = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "prompt_logprobs": 0,
                "ignore_eos": True}  # fmt: skip
    turns = []
    if "decode" in by_role and "prefill" in by_role:  # a forced disaggregated turn
        routing = {"mode": "disaggregated", "engine_id": by_role["decode"],
                   "prefill_engine_id": by_role["prefill"]}  # fmt: skip
        turns.append(("disaggregated", routing))
    if "colocated" in by_role:
        turns.append(("colocated", {"mode": "colocated", "engine_id": by_role["colocated"]}))
    records = []
    for kind, routing in turns:
        out = await server.generate(f"check-v{version}-{kind}", FIXED_PROMPT, sampling, routing)
        choice, meta = out["choices"][0], out["prorsa"]
        tokens = choice["token_ids"]
        engine_lp = [e["logprob"] for e in choice["logprobs"]["content"]]
        prompt_lp = [next(iter(e.values()))["logprob"] for e in out["prompt_logprobs"][1:]]
        trainer_lp, rows = token_logprobs(model, FIXED_PROMPT + tokens)
        n = len(FIXED_PROMPT) - 1
        out_rows = rows[n:]
        best = out_rows.max(-1).values
        chosen = out_rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        record = {
            "kind": kind,
            "version": meta["weight_version"],
            "decode_engine": meta["decode_engine_id"],
            "prefill_engine": meta["prefill_engine_id"],
            "path": meta["path"],
            # a greedy token must be the trainer's argmax, up to float ties
            "greedy_matches": bool(((best - chosen) <= 1e-3).all()),
            "output_logprob_max_diff": _max_diff(engine_lp, trainer_lp[n:].tolist()),
            "prompt_logprob_max_diff": _max_diff(prompt_lp, trainer_lp[:n].tolist()),
            "output_logprobs": engine_lp,
        }
        # Every engine holds the same weights: compare with the last version's turn of this
        # kind, whichever engines served it.
        if kind in previous:
            record["changed_since_previous_version"] = _max_diff(engine_lp, previous[kind]) > 1e-4
        previous[kind] = engine_lp
        records.append(record)
    return records


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def train(
    url: str, model_dir: str, out_dir: Path, cfg: GRPOConfig, token: str | None = None
) -> list[dict]:
    """The GRPO loop against a running server; returns one record per step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prorsa.runtime.ray.tools import PythonEvalTool

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).float()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    server, tool = Server(url, token), PythonEvalTool()
    prompts = [[1, *rng.sample(range(3, 250), 6)] for _ in range(cfg.prompts)]
    roles = await server.roles()
    if "colocated" not in roles.values():  # start from one engine per role
        engine = max(e for e, r in roles.items() if r == "decode")
        await server.post("/prorsa/switch_role", json={"engine_id": engine, "role": "colocated"})
    version = int((await server.http.get("/weight_info")).json()["weight_version"])
    previous: dict = {}
    with torch.no_grad():
        await check_engines(server, model, version, previous)
    history = []
    for step in range(cfg.steps):
        started = time.perf_counter()
        jobs = [
            asyncio.ensure_future(run_trajectory(
                server, tool, tokenizer, f"s{step}-g{g}-{i}", g, prompts[g], cfg,
                seed=cfg.seed * 1_000_003 + step * 10_007 + g * 101 + i * 2,
            ))
            for g in range(cfg.prompts) for i in range(cfg.group_size)
        ]  # fmt: skip
        await asyncio.sleep(0.05)  # trajectories are in flight: switch roles under them
        switches = await rotate_roles(server)
        trajs = await asyncio.gather(*jobs)
        stats = grpo_update(model, optimizer, list(trajs), cfg)
        folder = out_dir / f"step_{step + 1}"
        model.save_pretrained(folder, safe_serialization=True)
        sync = await server.post("/update_weights", json={"weight_dir": str(folder)})
        with torch.no_grad():
            checks = await check_engines(server, model, sync["version"], previous)
        record = {
            "step": step,
            "mean_reward": sum(t.reward for t in trajs) / len(trajs),
            "rollout_versions": sorted({v for t in trajs for v in t.versions}),
            "paths": sorted({p for t in trajs for p in t.paths}),
            "switches": [(s["engine_id"], s["from"], s["to"]) for s in switches],
            "weight_version": sync["version"],
            "sync_s": sync["total_s"],
            "checks": checks,
            "step_s": time.perf_counter() - started,
            **stats,
        }
        history.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "checks"}), flush=True)
    await server.http.aclose()
    return history


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--url", help="a running prorsa server (default: start one here)")
    parser.add_argument("--model", help="model folder (default: a fresh tiny model)")
    parser.add_argument("--out", default=None, help="where weights and history go")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo-tiny-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model
    if model_dir is None:
        from prorsa.runtime.ray.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(out / "initial", seed=args.seed))
    cfg = GRPOConfig(steps=args.steps, seed=args.seed)
    if args.url:
        history = asyncio.run(train(args.url, model_dir, out, cfg))
    else:
        from prorsa.serve import ServeConfig
        from prorsa.serve.server import BackgroundServer

        config = ServeConfig(model=model_dir, engines=3, policy="static",
                             policy_params={"prefill_gpus": 1}, port=args.port,
                             kv_cache_gib=0.125, seed=args.seed)  # fmt: skip
        with BackgroundServer(config) as server:
            history = asyncio.run(train(server.url, model_dir, out, cfg))
    (out / "history.json").write_text(json.dumps(history, indent=2) + "\n")
    return history


if __name__ == "__main__":
    main()
