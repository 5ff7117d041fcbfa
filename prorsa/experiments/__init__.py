"""Experiments built on the simulator: policy comparison and its report."""

#: The forecaster the predictive and mpc policies use in comparisons, tuning and the
#: regime map when none is named (the oracle policy has its own): the composite whose
#: prefill forecast meets its goal in every held-out cell, simulated and replayed
#: (prorsa.forecast.per_target; docs/results.md, "A per-target composite").
DEFAULT_FORECASTER = "per-target"
