"""Flax NNX models for training benchmarks: a decoder-only transformer (GPT-2 and Llama-3 shapes), a
Mixtral-style mixture of experts, ViT, ResNet-50; their synthetic data, optimizer, FLOP counts and train
step; pipeline, expert and context parallelism."""

from microbench.models.registry import DEFAULT_SIZE, FAMILIES, ModelError, ModelSpec, get_model

__all__ = ["DEFAULT_SIZE", "FAMILIES", "ModelError", "ModelSpec", "get_model"]
