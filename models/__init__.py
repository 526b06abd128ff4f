"""Flax NNX models for training benchmarks: a decoder-only transformer (GPT-2 and Llama-3 shapes), ViT,
ResNet-50; their synthetic data, optimizer, FLOP counts and train step."""

from models.registry import DEFAULT_SIZE, FAMILIES, ModelError, ModelSpec, get_model

__all__ = ["DEFAULT_SIZE", "FAMILIES", "ModelError", "ModelSpec", "get_model"]
