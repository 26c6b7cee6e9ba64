"""Backend pools per model: health, circuits, balancing strategies and active probes."""

from proxy.routing.circuit import Circuit
from proxy.routing.health import BackendHealth
from proxy.routing.pool import ModelPool, Pools, PoolSignals
from proxy.routing.prober import Prober
from proxy.routing.strategies import LeastInflight, PrefixAffinity, Strategy, Weighted, prefix_key

__all__ = [
    "BackendHealth",
    "Circuit",
    "LeastInflight",
    "ModelPool",
    "PoolSignals",
    "Pools",
    "PrefixAffinity",
    "Prober",
    "Strategy",
    "Weighted",
    "prefix_key",
]
