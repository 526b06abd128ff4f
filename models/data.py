"""Synthetic batches made on the devices (nothing is downloaded), already sharded along `batch`.

Token sequences are arithmetic progressions modulo the vocabulary with a random start and stride, so
the loss can fall (the next token follows from the previous two); images are noise plus a per-class
pattern. The generator is threefry-partitionable, so a batch is the same on one device or sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_batch(key: jax.Array, batch: int, seq_len: int, vocab: int) -> dict[str, jax.Array]:
  """{'inputs', 'targets'}: int32 [batch, seq_len], targets shifted by one."""
  k_start, k_stride = jax.random.split(key)
  start_B1 = jax.random.randint(k_start, (batch, 1), 0, vocab)
  stride_B1 = jax.random.randint(k_stride, (batch, 1), 1, 8)
  seq_BT = (start_B1 + stride_B1 * jnp.arange(seq_len + 1)[None, :]) % vocab
  seq_BT = seq_BT.astype(jnp.int32)
  return {"inputs": seq_BT[:, :-1], "targets": seq_BT[:, 1:]}


def image_batch(key: jax.Array, batch: int, image_size: int, channels: int, classes: int
                ) -> dict[str, jax.Array]:
  """{'images': float32 [batch, H, W, C], 'labels': int32 [batch]}."""
  k_label, k_noise = jax.random.split(key)
  labels_B = jax.random.randint(k_label, (batch,), 0, classes)
  patterns = jax.random.normal(jax.random.key(1234), (classes, image_size, image_size, channels))
  noise = jax.random.normal(k_noise, (batch, image_size, image_size, channels))
  return {"images": noise + patterns[labels_B], "labels": labels_B.astype(jnp.int32)}
