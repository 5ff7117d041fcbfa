"""The cluster model both runtimes share: routing rules, the role-switch state machine,
the telemetry emitter, the observation and the configuration.

The simulator (:mod:`prorsa.runtime.sim`) wires these to simulated events, the Ray
runtime (:mod:`prorsa.runtime.ray`) to asyncio; a routing or switch change made here
holds in both.
"""
