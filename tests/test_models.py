"""Model shapes (parameter counts of the published sizes) and FLOP formulas. (The vision models' gradients
under every strategy: test_equivalence.py.)"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from microbench.models import ModelError, flops, get_model  # noqa: E402
from microbench import train  # noqa: E402


def _param_count(family: str, size: str, **kw) -> int:
  spec = get_model(family, size, **kw)
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: spec.make(jnp.float32, 0))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("family,size,count", [
    ("gpt2", "124m", 124_439_808 + 47 * 768),  # GPT-2 small, vocabulary padded 50257 -> 50304
    ("llama3", "8b", 8_030_261_248),
    ("vit", "h14", 632_045_800),  # timm vit_huge_patch14_224
    ("resnet", "50", 25_557_032),  # torchvision resnet50
    ("mixtral", "8x7b", 46_702_792_704),  # Mixtral-8x7B-v0.1
    ("minerva", "7b", 7_399_542_784),  # the study's DP+PP model (docs/study.md)
])
def test_published_parameter_counts(family, size, count):
  assert _param_count(family, size) == count


def test_layers_override_reduces_depth():
  full, two = _param_count("llama3", "8b"), _param_count("llama3", "8b", layers=2)
  per_layer = (full - two) // 30
  assert full - 30 * per_layer == two and per_layer == 218_112_000
  # Llama-3 70B (80 layers) from two reduced-depth builds, so the test never builds 80 layers.
  one, two = _param_count("llama3", "70b", layers=1), _param_count("llama3", "70b", layers=2)
  assert one + 79 * (two - one) == 70_553_706_496


def test_flop_formulas():
  spec = get_model("gpt2", "124m", seq_len=1024)
  n_matmul = 12 * 12 * 768 * 768 + 768 * 50304  # 12 layers x (4d^2 attention + 8d^2 MLP) + LM head
  full = 1024 * (6 * n_matmul + 12 * 12 * 1024 * 768)  # attention counted in full (PaLM)
  causal = 1024 * (6 * n_matmul + 6 * 12 * 1024 * 768)  # causal attention counted half (MaxText, Megatron-LM)
  assert spec.step_flops(1) == pytest.approx(causal)
  assert spec.step_flops(1, causal_half=False) == pytest.approx(full)
  # torchvision's ResNet-50 is 4.09 GMACs per 224x224 image.
  assert flops.resnet_forward_flops(get_model("resnet", "50").config) / 2 == pytest.approx(4.09e9, rel=0.01)
  vit = get_model("vit", "h14")
  assert vit.seq_len == 257 and vit.step_flops(2) == pytest.approx(2 * vit.step_flops(1))
  assert vit.step_flops(1) == vit.step_flops(1, causal_half=False)  # not causal: both conventions agree


def test_model_flops_close_to_xla_count():
  """The stated formula and XLA's own count of the compiled single-device step agree for a matmul-bound
  shape (XLA also counts element-wise work, hence the tolerance; its attention computes the whole masked
  score matrix, so the full-attention count is the one to compare). One layer: XLA counts a loop body once."""
  cfg = train.TrainConfig(model="gpt2", size="124m", layers=1, seq_len=128, batch=2, parallelism="dp:1",
                          compile_only=True, write=False, verbose=False,
                          compiler_options={"xla_backend_optimization_level": 0})
  s = train.run(cfg, train.plan(cfg, jax.devices()[:1])).summary
  assert s["hlo_flops_per_device"] == pytest.approx(s["flops_per_step_full_attention"], rel=0.05)


@pytest.mark.parametrize("bad,match", [
    (dict(family="gpt3"), "unknown model"),
    (dict(family="gpt2", size="7b"), "unknown size"),
    (dict(family="resnet", size="50", layers=3), "fixed depth"),
    (dict(family="gpt2", size="tiny", seq_len=4096), "learned positions"),
])
def test_model_errors(bad, match):
  with pytest.raises(ModelError, match=match):
    get_model(**bad)
