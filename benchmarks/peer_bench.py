"""End to end beside a Python peer: prorsa and SplitwiseSim on the same trace and cluster.

Both simulate the 8,819-request Azure LLM code trace (2023, ``shared/data/traces``) at its
recorded arrival times on 20 machines split 10 prefill / 10 decode, and each is timed as a
user runs it, from the published CSV to its written results, interpreter start-up and
imports included:

* prorsa: ``prorsa traces import`` (CSV to lifecycle Parquet), then ``prorsa simulate
  --trace --arrivals --engines 20 --role-tp prefill=8 ... --policy static --param
  prefill_fraction=0.5`` on the H100 Qwen2.5-32B TP8 roofline profile, one 8-GPU engine
  per machine (telemetry and metrics written);
* SplitwiseSim (github.com/Mutinifni/splitwise-sim, given as ``--splitwise DIR``): its
  ``run.py`` with the Splitwise-HH start state, 10 prompt and 10 token DGX-H100
  instances, Llama-2-70B on its measured performance database, the trace converted to its
  CSV format (arrivals shifted by 1 s: its instances start at t = 0, and a request at
  exactly 0 finds none).

Runs alternate between the two so both see the same machine load; the minimum over
repeats is reported (the closest to an idle machine) beside the median. The peer's own
event-loop seconds are read from its log (``TraceSimulator initialized`` to
``completed``). The peer runs in a copy of its tree with the Ray launcher taken out of its
``config.yaml`` (a single local run needs none).

    .venv/bin/python benchmarks/peer_bench.py --splitwise DIR [--peer-python PY]

``PY`` is an interpreter with SplitwiseSim's requirements (hydra-core, omegaconf, pandas,
scipy, networkx); default: this one. Writes ``results/peer_splitwise.json``.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save

ROOT = Path(__file__).resolve().parents[1]
ENGINES = 20
PROFILE = "h100-qwen2.5-32b-tp8-roofline"
_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\].*TraceSimulator (\w+)")


def splitwise_trace(src: Path, dest: Path) -> int:
    """Write the Azure CSV in SplitwiseSim's trace format; returns the request count."""
    from prorsa.telemetry.importers.fields import parse_iso

    with src.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    first = parse_iso(rows[0]["TIMESTAMP"].strip())
    with dest.open("w") as out:
        out.write("request_id,request_type,application_id,arrival_timestamp,")
        out.write("batch_size,prompt_size,token_size\n")
        for i, row in enumerate(rows):
            arrival = parse_iso(row["TIMESTAMP"].strip()) - first + 1.0
            out.write(
                f"{i},2,0,{arrival:.6f},1,{int(row['ContextTokens'])},"
                f"{int(row['GeneratedTokens'])}\n"
            )
    return len(rows)


def prepare_splitwise(checkout: Path, trace: Path, work: Path) -> Path:
    """A copy of the peer's tree with the trace added and the Ray launcher taken out."""
    tree = work / "splitwise"
    shutil.copytree(checkout, tree, ignore=shutil.ignore_patterns(".git", "results"))
    config = tree / "configs" / "config.yaml"
    text = config.read_text().replace("  - override hydra/launcher: ray\n", "")
    text = re.sub(r"\n  launcher:\n    ray:\n(?:      .*\n)*", "\n", text)
    if "launcher: ray" in text or "\n    ray:" in text:
        raise RuntimeError(f"{config}: could not take the Ray launcher out (changed upstream?)")
    config.write_text(text)
    splitwise_trace(trace, tree / "traces" / "azure_code.csv")
    return tree


def _timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, done.stdout + done.stderr


def run_prorsa(trace: Path, work: Path) -> dict[str, float]:
    prorsa = str(Path(sys.executable).parent / "prorsa")
    parquet = work / "code.parquet"
    import_s, _ = _timed(
        [prorsa, "traces", "import", str(trace), "-f", "azure", "-o", str(parquet)], work
    )
    simulate_s, _ = _timed(
        [
            prorsa, "simulate", "--trace", str(parquet), "--arrivals", "--engines", str(ENGINES),
            "--profile", PROFILE, "--role-tp", "prefill=8", "--role-tp", "decode=8",
            "--role-tp", "colocated=8", "--policy", "static", "--param", "prefill_fraction=0.5",
            "--out", str(work / "prorsa-out"),
        ],
        work,
    )  # fmt: skip
    return {"wall_s": import_s + simulate_s, "import_s": import_s, "simulate_s": simulate_s}


def run_splitwise(tree: Path, python: str) -> dict[str, float]:
    wall, log = _timed(
        [
            python, "run.py", "applications.0.scheduler=mixed_pool",
            "applications.0.model_architecture=llama2-70b",
            "applications.0.model_size=llama2-70b-fp16", "cluster=half_half",
            "cluster.servers.0.count=0", f"cluster.servers.1.count={ENGINES}",
            "start_state=splitwise", f"start_state.prompt.num_instances={ENGINES // 2}",
            f"start_state.token.num_instances={ENGINES // 2}", "performance_model=db",
            "trace.filename=azure_code", "debug=False", "seed=0",
        ],
        tree,
    )  # fmt: skip
    stamps = {}
    for line in log.splitlines():
        hit = _LOG_TIME.match(line)
        if hit:
            stamps[hit.group(2)] = datetime.strptime(hit.group(1), "%Y-%m-%d %H:%M:%S,%f")
    loop = None
    if "completed" in stamps and "initialized" in stamps:
        loop = (stamps["completed"] - stamps["initialized"]).total_seconds()
    return {"wall_s": wall, "event_loop_s": loop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splitwise", type=Path, required=True, help="SplitwiseSim checkout")
    parser.add_argument("--peer-python", default=sys.executable, help="its interpreter")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", type=Path, help="Azure code trace CSV (default: shared)")
    args = parser.parse_args()
    from prorsa.telemetry.importers import shared_data_dir

    trace = args.trace or (
        shared_data_dir() / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tree = prepare_splitwise(args.splitwise, trace, work)
        with trace.open() as handle:
            requests = sum(1 for _ in handle) - 1
        ours, peer = [], []
        for _ in range(args.repeats):
            ours.append(run_prorsa(trace, work))
            peer.append(run_splitwise(tree, args.peer_python))
            print(f"prorsa {ours[-1]['wall_s']:.2f} s, SplitwiseSim {peer[-1]['wall_s']:.2f} s")

    def summary(runs: list[dict]) -> dict:
        walls = [r["wall_s"] for r in runs]
        best = min(runs, key=lambda r: r["wall_s"])
        return {
            "best": best,
            "wall_s_median": statistics.median(walls),
            "requests_per_wall_s": requests / best["wall_s"],
        }

    result = {
        "trace": str(trace.name),
        "requests": requests,
        "cluster": f"{ENGINES} machines, {ENGINES // 2} prefill / {ENGINES // 2} decode",
        "method": "CLI to CLI, CSV to written results, alternating runs; best of repeats",
        "prorsa": summary(ours),
        "splitwise_sim": summary(peer),
        "runs": {"prorsa": ours, "splitwise_sim": peer},
    }
    result["speedup_end_to_end"] = (
        result["splitwise_sim"]["best"]["wall_s"] / result["prorsa"]["best"]["wall_s"]
    )
    result["goal"] = {"speedup": 20.0, "met": result["speedup_end_to_end"] >= 20.0}
    path = save("peer_splitwise", result)
    loop = result["splitwise_sim"]["best"]["event_loop_s"]
    print(
        f"{requests:,} requests: prorsa {result['prorsa']['best']['wall_s']:.2f} s, "
        f"SplitwiseSim {result['splitwise_sim']['best']['wall_s']:.2f} s (its event loop "
        f"{'?' if loop is None else f'{loop:.2f}'} s): "
        f"{result['speedup_end_to_end']:.2f}x end to end; wrote {path}"
    )


if __name__ == "__main__":
    main()
