"""eagle3-jax: EAGLE-3 speculative decoding for large MoE models, in pure JAX.

Public API (kept stable):
    load_target, Target, load_draft, Draft, Engine, Scheduler, CapacityError, SpecConfig, AutoSpec,
    SamplingParams, RequestOutput, make_mesh, initialize_distributed, plan_memory,
    load_tokenizer, Tokenizer, TokenizerError (a folder's tokenizer.json or Kimi's tiktoken.model layout),
    ChatOutput (Engine.chat's answers), parse_tool_calls, parse_reasoning, ParserError (model outputs'
    tool-call and reasoning markup, by vLLM's parser names), Constraint, ConstraintError (structured
    output: SamplingParams.constraint)
"""

from .config.model import ConfigError, ModelConfig, load_model_config
from .engine import ChatOutput, Engine
from .models.draft import Draft, load_draft
from .models.target import Target, load_target
from .parsers import ParserError, parse_reasoning, parse_tool_calls
from .planning.memory import plan_memory
from .request import RequestOutput
from .runtime.sharding import initialize_distributed, make_mesh
from .sampling.sampler import SamplingParams
from .scheduler import CapacityError, Scheduler
from .spec_decode import AutoSpec, SpecConfig
from .structured import Constraint, ConstraintError
from .text.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "AutoSpec",
    "ChatOutput",
    "ParserError",
    "parse_reasoning",
    "parse_tool_calls",
    "CapacityError",
    "ConfigError",
    "Constraint",
    "ConstraintError",
    "Draft",
    "SpecConfig",
    "load_draft",
    "Engine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "Target",
    "Tokenizer",
    "TokenizerError",
    "initialize_distributed",
    "load_model_config",
    "load_target",
    "load_tokenizer",
    "make_mesh",
    "plan_memory",
]
