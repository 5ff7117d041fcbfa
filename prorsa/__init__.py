"""prorsa: forecast-driven prefill/decode allocation for agentic RL rollout.

Heavy dependencies (torch, lightgbm, ray, vllm, optuna, mlflow) are imported by the
modules that use them, never here, so ``import prorsa`` stays cheap.
"""

__version__ = "0.1.0"
