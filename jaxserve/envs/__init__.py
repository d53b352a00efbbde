"""gymnax environments built on the engine, and their registry."""

from jaxserve.envs.autoscaling import Autoscaling, AutoscalingParams, AutoscalingState
from jaxserve.envs.batching import Batching, BatchingState
from jaxserve.envs.common import ServingParams
from jaxserve.envs.registry import make, register, registered_envs
from jaxserve.envs.routing import Routing, RoutingState

__all__ = ["Autoscaling", "AutoscalingParams", "AutoscalingState", "Batching", "BatchingState",
           "Routing", "RoutingState", "ServingParams", "make", "register", "registered_envs"]
