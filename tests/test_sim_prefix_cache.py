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
