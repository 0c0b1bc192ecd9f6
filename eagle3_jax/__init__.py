"""eagle3-jax: EAGLE-3 speculative decoding for large MoE models, in pure JAX.

Public API (kept stable):
    load_target, Target, load_draft, Draft, Engine, Scheduler, CapacityError, SpecConfig, AutoSpec,
    SamplingParams, RequestOutput, make_mesh, initialize_distributed, plan_memory,
    load_tokenizer, Tokenizer, TokenizerError (a folder's tokenizer.json or Kimi's tiktoken.model layout),
    ChatOutput (Engine.chat's answers), parse_tool_calls, parse_reasoning, ParserError (model outputs'
    tool-call and reasoning markup, by vLLM's parser names), Constraint, ConstraintError (structured
    output: SamplingParams.constraint)
"""

from .config import ConfigError, ModelConfig, load_model_config
from .draft import Draft, load_draft
from .engine import ChatOutput, Engine
from .parsers import ParserError, parse_reasoning, parse_tool_calls
from .plan import plan_memory
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import CapacityError, Scheduler
from .sharding import initialize_distributed, make_mesh
from .spec_decode import AutoSpec, SpecConfig
from .structured import Constraint, ConstraintError
from .target import Target, load_target
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer

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
