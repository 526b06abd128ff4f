"""Model FLOPs per training step, from the shapes (the count MFU is quoted against).

Training = 3 x forward (backward = 2 x forward). A multiply-add is 2 FLOPs. Embedding lookups, norms,
softmax and element-wise ops are not counted. Causal attention is counted half (only the lower triangle of
the scores is needed), as MaxText and Megatron-LM count it today; the full-attention count (PaLM's) is
reported beside it:
  decoder: tokens x (6 x N_matmul + 6 x L x T x H x Dh),  N_matmul = block weights + LM head (d x V)
           (full attention: 12 x L x T x H x Dh)
  MoE decoder: the same with the experts' weights counted k/E (the active ones) and the router (d x E)
  ViT:     images x (6 x N_matmul x T + 12 x L x T^2 x H x Dh + 6 x d x classes),  T = patches + 1
           (not causal: both conventions agree)
  ResNet:  images x 3 x sum over convs and the head of 2 x H_out x W_out x k^2 x C_in x C_out
"""

from __future__ import annotations

from microbench.models.layers import BlockConfig
from microbench.models.resnet import ResNetConfig
from microbench.models.transformer import TransformerConfig
from microbench.models.vit import ViTConfig

MOE_FORMULA = ("tokens*(6*N_active + 6*L*T*H*Dh), causal attention counted half (full: 12*L*T*H*Dh),"
               " N_active = attention + k/E of the experts + router + d*V head")
DECODER_FORMULA = ("tokens*(6*N_matmul + 6*L*T*H*Dh), causal attention counted half (full: 12*L*T*H*Dh),"
                   " N_matmul = block weights + d*V head")
VIT_FORMULA = "images*(6*N_matmul*T + 12*L*T^2*H*Dh + 6*d*classes), T = patches+1"
RESNET_FORMULA = "images*3*sum_convs(2*Hout*Wout*k^2*Cin*Cout) + head"


def block_matmul_params(b: BlockConfig) -> int:
  """Weights of one block that take part in matmuls (attention QKVO + MLP)."""
  attn = b.d_model * b.head_dim * (2 * b.num_heads + 2 * b.num_kv_heads)
  mlp = (3 if b.mlp == "swiglu" else 2) * b.d_model * b.d_ff
  return attn + mlp


def decoder_step_flops(cfg: TransformerConfig, batch: int, seq_len: int, causal_half: bool = True) -> float:
  """Model FLOPs of one training step; `causal_half=False` counts the causal attention in full."""
  b = cfg.block
  n_matmul = cfg.num_layers * block_matmul_params(b) + b.d_model * cfg.vocab_size
  attn = 12 * cfg.num_layers * seq_len * b.num_heads * b.head_dim
  if causal_half and b.causal:
    attn //= 2
  return float(batch * seq_len) * (6 * n_matmul + attn)


def moe_step_flops(cfg, batch: int, seq_len: int, causal_half: bool = True) -> float:
  """A Mixtral-style decoder (`microbench.models.mixtral.MixtralConfig`): each token runs k of the E experts."""
  b, moe = cfg.block, cfg.moe
  attn_w = b.d_model * b.head_dim * (2 * b.num_heads + 2 * b.num_kv_heads)
  experts_w = moe.top_k * 3 * b.d_model * b.d_ff
  n_active = cfg.num_layers * (attn_w + experts_w + b.d_model * moe.num_experts) + b.d_model * cfg.vocab_size
  attn = 12 * cfg.num_layers * seq_len * b.num_heads * b.head_dim
  if causal_half and b.causal:
    attn //= 2
  return float(batch * seq_len) * (6 * n_active + attn)


def vit_step_flops(cfg: ViTConfig, batch: int) -> float:
  b, t = cfg.block, cfg.seq_len
  n_matmul = cfg.num_layers * block_matmul_params(b) + cfg.patch * cfg.patch * cfg.channels * b.d_model
  per_image = 6 * n_matmul * t + 12 * cfg.num_layers * t * t * b.num_heads * b.head_dim \
      + 6 * b.d_model * cfg.num_classes
  return float(batch) * per_image


def resnet_forward_flops(cfg: ResNetConfig) -> float:
  """Forward FLOPs of one image, walking the same structure as `microbench.models.resnet.ResNet`."""
  def conv(s_out: int, k: int, cin: int, cout: int) -> float:
    return 2.0 * s_out * s_out * k * k * cin * cout

  s = -(-cfg.image_size // 2)
  total = conv(s, 7, cfg.channels, cfg.width)
  s = -(-s // 2)  # max pool
  cin = cfg.width
  for i, n in enumerate(cfg.stage_blocks):
    width = cfg.width * 2 ** i
    for j in range(n):
      stride = 2 if (j == 0 and i > 0) else 1
      s_out = -(-s // stride)
      total += conv(s, 1, cin, width) + conv(s_out, 3, width, width) + conv(s_out, 1, width, 4 * width)
      if stride != 1 or cin != 4 * width:
        total += conv(s_out, 1, cin, 4 * width)
      cin, s = 4 * width, s_out
  return total + 2.0 * cin * cfg.num_classes


def resnet_step_flops(cfg: ResNetConfig, batch: int) -> float:
  return 3.0 * batch * resnet_forward_flops(cfg)
