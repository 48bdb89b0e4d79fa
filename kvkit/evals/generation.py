"""The evals' import path of the prompt and generation helpers they share with the calibrations:
:mod:`kvkit.workloads.prompts` (prompt text, tokens, context checks) and :mod:`kvkit.workloads.generation` (a greedy
generation under a policy's cache)."""

from kvkit.workloads.generation import Generation, generate
from kvkit.workloads.prompts import (
           build_prompt,
           check_length,
           count_tokens,
           encode,
           has_chat_template,
           model_context,
)

__all__ = ["Generation", "build_prompt", "check_length", "count_tokens", "encode", "generate", "has_chat_template",
           "model_context"]
