"""jaxserve: JAX-native reinforcement-learning environments for ML/LLM inference serving."""

from jaxserve.core.types import GPUProfile, Trace, stack_profiles
from jaxserve.core.replica import ReplicaProfile, replica_profile, stack_replicas
from jaxserve.envs import make, register, registered_envs
from jaxserve.evaluation.replay import replay, replay_prefix
from jaxserve.evaluation import capacity, evaluate, evaluate_many
from jaxserve import policies

__all__ = ["GPUProfile", "Trace", "make", "register", "registered_envs", "replay",
           "stack_profiles"]
__all__ += ["capacity", "evaluate", "evaluate_many", "policies"]
__all__ += ["ReplicaProfile", "replica_profile", "stack_replicas"]
__all__ += ["replay_prefix"]
__version__ = "0.1.0"
