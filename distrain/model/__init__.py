"""The transformer family, its tensor-parallel plan, its parameter count and its training FLOPs per token."""

from distrain.model.llama import Transformer, flops_per_token, num_params, tp_plan

__all__ = ["Transformer", "flops_per_token", "num_params", "tp_plan"]
