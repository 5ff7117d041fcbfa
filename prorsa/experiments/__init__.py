"""Experiments built on the simulator: policy comparison and its report."""
