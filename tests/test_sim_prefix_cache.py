"""The simulated prefix cache: LRU space accounting, and which entries count as live."""

from __future__ import annotations

from prorsa.runtime.sim.prefix_cache import PrefixCache


def test_a_retired_entry_keeps_its_space_until_evicted_but_is_not_live():
    cache = PrefixCache()
    cache.put("t:a", 100)
    cache.put("t:b", 40)
    cache.put("g:grp", 10)
    cache.retire("t:a")
    cache.retire("t:a")  # twice changes nothing
    cache.retire("t:missing")  # not cached here: nothing to retire
    assert (cache.total, cache.live_tokens) == (150, 50)
    # Eviction takes the oldest first, the retired one here, and forgets it was retired.
    assert cache.evict_until(free_needed=100, free_now=0) == 100
    assert (cache.total, cache.live_tokens, cache.retired) == (50, 50, set())


def test_a_retired_key_used_again_is_live_again():
    # A trajectory id run anew (another rollout step) refreshes its entry.
    cache = PrefixCache()
    cache.put("t:a", 100)
    cache.retire("t:a")
    cache.put("t:a", 120)
    assert (cache.total, cache.live_tokens) == (120, 120)
    cache.retire("t:a")
    assert cache.take("t:a") == 120
    assert (cache.total, cache.live_tokens, cache.retired_tokens) == (0, 0, 0)


def test_clearing_forgets_retired_entries_too():
    cache = PrefixCache()
    cache.put("t:a", 100)
    cache.put("t:b", 30)
    cache.retire("t:b")
    cache.clear()
    assert (cache.total, cache.live_tokens, cache.evicted_tokens) == (0, 0, 130)


def test_a_slot_counts_the_live_trajectories_contexts_once():
    # Mid-run on a grouped workload: the slots' cached tokens are the entries of the
    # trajectories still running, not the finished ones' nor the groups' shared prompts
    # (each member's own entry already holds its prompt).
    from prorsa.policy import make_policy
    from prorsa.runtime.cluster.config import ClusterConfig
    from prorsa.runtime.sim.drivers import SyncDriver
    from prorsa.runtime.sim.simulation import Simulation
    from prorsa.workload import get_scenario

    specs = get_scenario("math-tool").sample(32, seed=0, group_size=4)
    assert all(s.shared_prompt_tokens > 0 for s in specs)
    config = ClusterConfig(profile="h200-qwen2.5-7b-tp1", num_slots=4)
    sim = Simulation(config, make_policy("colocate"), SyncDriver([specs]), record=False)
    sim.start()
    engines = list(sim.cluster.engines.values())
    checked = 0
    for t in range(10, 400, 10):
        sim.advance(float(t))
        live = {"t:" + trajectory_id for trajectory_id in sim.cluster.live}
        if not live:
            break
        held = sum(v for e in engines for k, v in e.cache.entries.items() if k in live)
        views = sim.actuator.observe().slots
        assert sum(s.cached_tokens for s in views) == held
        stale = sum(e.cache.total for e in engines) - held
        checked += stale > 0  # finished trajectories' or groups' entries were left out
    assert checked >= 3
