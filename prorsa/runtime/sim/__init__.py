"""Discrete-event simulator of a disaggregated rollout cluster, and its cost models."""
