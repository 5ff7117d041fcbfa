"""Runtimes that execute rollouts: a simulator (``sim``) and a real Ray + vLLM cluster (``ray``)."""
