"""Real rollout runtime: Ray actors hosting vLLM engines, a PD router and role pools.

Modules (import from them; this package imports nothing heavy):

* ``config``: :class:`EngineConfig` (one engine; KV connector ``auto|nixl|example|None``).
* ``engine``: :class:`EngineServer`, the Ray actor body around ``vllm``'s ``AsyncLLM``
  (token-in/token-out ``generate``/``generate_stream``, ``health``, ``pause``/``resume``,
  ``reset_prefix_cache``, ``abort``, ``release_kv``, ``shutdown``).
* ``cluster``: :class:`EngineFleet` starts engines in one placement group and stops them.
* ``client``: the async :class:`EngineClient` protocol the router uses; Ray adapter.
* ``pools``: :class:`RolePools`, engine roles (prefill, decode, colocated, switching),
  leases of running legs, liveness.
* ``router``: :class:`PDRouter` (disaggregated / local-prefill / colocated turns, sticky
  routing, retries after engine death, lifecycle telemetry); ``turns`` holds its config,
  request and result types.
* ``switch``: the live role switch (stop, drain, abort + re-route, pause, reset, resume).
* ``actuator``: :class:`RayActuator` and :class:`AsyncioClock` for the controller;
  ``load`` (vLLM stat logger: KV use, queues) and ``monitor`` (background polling) feed
  its observations.
* ``agent``: the multi-turn agent loop; ``tools`` (sandboxed Python, BM25 search, a
  latency tool); ``specs`` fits scenario specs to the engines and makes their tokens.
* ``rollout``: :func:`run_rollout` end to end (``rollout_config``, ``rollout_metrics``);
  ``cpu_profile`` registers the cost profile fitted to these engines.
* ``tiny_model``: a random tiny Llama and local tokenizer for tests and demos.

Choices worth knowing:

* Every engine is ``kv_both``, so a role is router policy, not engine state: a switch
  needs no restart, only a drain (vLLM 0.32 has no runtime KV-role API).
* A decode leg re-run after a failure or eviction starts from a fresh prefill leg: KV
  already pulled by a dead engine may have been freed on the prefill side.
* On CPU each engine runs its worker inside the EngineCore process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one process and ~10 s of start-up less.
"""
