"""Discrete-event simulator of a prefill/decode-disaggregated rollout cluster, and its cost models."""
