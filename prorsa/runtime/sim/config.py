"""Moved: both runtimes share the cluster configuration (``prorsa.runtime.cluster.config``)."""

from prorsa.runtime.cluster.config import REUSE_MODES, SWITCH_MODES, ClusterConfig, config_help

__all__ = ["REUSE_MODES", "SWITCH_MODES", "ClusterConfig", "config_help"]
