"""eagle3-jax: EAGLE-3 speculative decoding for large MoE models, in pure JAX.

Public API (kept stable):
    load_target, Target, load_draft, Draft, Engine, Scheduler, CapacityError, SpecConfig, AutoSpec,
    SamplingParams, RequestOutput, make_mesh, initialize_distributed, plan_memory,
    load_tokenizer, Tokenizer, TokenizerError (a folder's tokenizer.json or Kimi's tiktoken.model layout),
    ChatOutput (Engine.chat's answers), parse_tool_calls, parse_reasoning, ParserError (model outputs'
    tool-call and reasoning markup, by vLLM's parser names), Constraint, ConstraintError (structured
    output: SamplingParams.constraint)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .runtime.exports import lazy_exports

# each public name and the module that defines it, imported on first use (runtime/exports.py)
_WHERE = {
    "AutoSpec": ".spec_decode",
    "CapacityError": ".scheduler",
    "ChatOutput": ".engine",
    "ConfigError": ".config.model",
    "Constraint": ".structured",
    "ConstraintError": ".structured",
    "Draft": ".models.draft",
    "Engine": ".engine",
    "ModelConfig": ".config.model",
    "ParserError": ".parsers",
    "RequestOutput": ".request",
    "SamplingParams": ".sampling.sampler",
    "Scheduler": ".scheduler",
    "SpecConfig": ".spec_decode",
    "Target": ".models.target",
    "Tokenizer": ".text.tokenizer",
    "TokenizerError": ".text.tokenizer",
    "initialize_distributed": ".runtime.sharding",
    "load_draft": ".models.draft",
    "load_model_config": ".config.model",
    "load_target": ".models.target",
    "load_tokenizer": ".text.tokenizer",
    "make_mesh": ".runtime.sharding",
    "parse_reasoning": ".parsers",
    "parse_tool_calls": ".parsers",
    "plan_memory": ".planning.memory",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)

if TYPE_CHECKING:  # the same names for type checkers and the structure test
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
