"""Real rollout runtime: Ray actors hosting vLLM engines, a PD router and role pools."""
