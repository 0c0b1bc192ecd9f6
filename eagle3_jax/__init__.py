"""eagle3-jax: EAGLE-3 speculative decoding for large MoE models, in pure JAX.

Public API (kept stable):
    load_target, Target, Engine, SamplingParams, RequestOutput, make_mesh, initialize_distributed
"""

from .config import ConfigError, ModelConfig, load_model_config
from .engine import Engine, RequestOutput
from .sampling import SamplingParams
from .sharding import initialize_distributed, make_mesh
from .target import Target, load_target

__all__ = [
    "ConfigError",
    "Engine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Target",
    "initialize_distributed",
    "load_model_config",
    "load_target",
    "make_mesh",
]
