"""Simulator speed: wall time, simulated seconds per wall second, turns per wall second.

(a) 64 engines, 2,048 swe trajectories, sync; (b) 512 engines, 16,384 mixed trajectories,
sync. Goal for (a): at least 500x faster than real time on one core. Also reports peak
memory, how wall time grows from 64 to 512 engines, and where the time goes (cProfile of
(a)). Writes benchmarks/results/sim.json.

    .venv/bin/python benchmarks/sim_bench.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import save
from prorsa.policy import make_policy
from prorsa.runtime.sim.config import ClusterConfig
from prorsa.runtime.sim.drivers import SyncDriver
from prorsa.runtime.sim.simulation import Simulation
from prorsa.workload import get_scenario

PROFILE = "h200-qwen2.5-7b-tp1"
CASES = {
    "a_64_engines_2048_swe": ("swe", 64, 2048),
    "b_512_engines_16384_mixed": ("mixed", 512, 16_384),
}


def run_case(scenario: str, engines: int, trajectories: int, *, record: bool) -> dict:
    specs = get_scenario(scenario).sample(trajectories, seed=0, group_size=8)
    turns = sum(s.num_turns for s in specs)
    sim = Simulation(
        ClusterConfig(profile=PROFILE, num_slots=engines),
        make_policy("colocate"),
        SyncDriver([specs]),
        record=record,
    )
    start = time.perf_counter()
    cpu0 = time.process_time()
    result = sim.run()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    makespan = float(result.metrics["makespan_s"])
    return {
        "scenario": scenario,
        "engines": engines,
        "trajectories": trajectories,
        "turns": turns,
        "telemetry": record,
        "events": result.telemetry.num_rows if record else None,
        "makespan_s": makespan,
        "wall_s": wall,
        "cpu_s": cpu,
        "sim_s_per_wall_s": makespan / wall,
        "turns_per_wall_s": turns / wall,
        "wall_us_per_turn": wall / turns * 1e6,
    }


def profile_case(scenario: str, engines: int, trajectories: int) -> list[dict]:
    specs = get_scenario(scenario).sample(trajectories, seed=0, group_size=8)
    sim = Simulation(
        ClusterConfig(profile=PROFILE, num_slots=engines),
        make_policy("colocate"),
        SyncDriver([specs]),
        record=True,
    )
    prof = cProfile.Profile()
    prof.enable()
    sim.run()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    rows = []
    total = stats.total_tt
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in sorted(
        stats.stats.items(), key=lambda kv: kv[1][2], reverse=True
    )[:15]:
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}({func})",
                "calls": ncalls,
                "self_s": tottime,
                "self_share": tottime / total,
                "cumulative_s": cumtime,
            }
        )
    return rows


def main() -> None:
    results = {}
    for name, (scenario, engines, n) in CASES.items():
        results[name] = run_case(scenario, engines, n, record=True)
        results[name + "_no_telemetry"] = run_case(scenario, engines, n, record=False)
        r = results[name]
        print(
            f"{name}: wall {r['wall_s']:.2f} s, simulated {r['makespan_s']:.0f} s "
            f"-> {r['sim_s_per_wall_s']:.0f}x real time, {r['turns_per_wall_s']:,.0f} turns/s "
            f"({r['wall_us_per_turn']:.1f} us/turn); without telemetry "
            f"{results[name + '_no_telemetry']['sim_s_per_wall_s']:.0f}x"
        )
    a, b = results["a_64_engines_2048_swe"], results["b_512_engines_16384_mixed"]
    scaling = {
        "engines_ratio": b["engines"] / a["engines"],
        "turns_ratio": b["turns"] / a["turns"],
        "wall_ratio": b["wall_s"] / a["wall_s"],
        "wall_per_turn_ratio": b["wall_us_per_turn"] / a["wall_us_per_turn"],
    }
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hot = profile_case("swe", 64, 2048)
    goal = a["sim_s_per_wall_s"] >= 500
    path = save(
        "sim",
        {
            "cases": results,
            "scaling_64_to_512": scaling,
            "peak_rss_mb": peak_mb,
            "profile_a_top": hot,
            "goal_a_500x_real_time": goal,
        },
    )
    print(
        f"64 -> 512 engines: {scaling['turns_ratio']:.1f}x the turns took "
        f"{scaling['wall_ratio']:.1f}x the wall time ({scaling['wall_per_turn_ratio']:.2f}x per "
        f"turn); peak RSS {peak_mb:,.0f} MB"
    )
    print("where the time goes in (a):")
    for row in hot[:8]:
        print(f"  {row['self_share']:5.1%}  {row['function']}  ({row['calls']:,} calls)")
    print(f"goal (a) >= 500x real time: {'met' if goal else 'NOT met'}; saved {path}")


if __name__ == "__main__":
    main()
