"""Experiments built on the simulator: policy comparison and its report."""

#: The forecaster the predictive and mpc policies use in comparisons, tuning and the
#: regime map when none is named (the oracle policy has its own).
DEFAULT_FORECASTER = "lightgbm-trajectory"
