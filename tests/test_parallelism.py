"""Strategies as data: --parallelism parsing, the rules table, placement, and the shardings parameters get."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # conftest does the same; JAX must see it before start

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from microbench.meshes import parallelism as par  # noqa: E402
from microbench.meshes.topology import Topology  # noqa: E402
from microbench.models import get_model  # noqa: E402
from microbench.models.optimizer import adamw  # noqa: E402
from microbench.models.train_step import Trainer  # noqa: E402


def test_parse_degrees_and_defaults():
  p = par.parse_parallelism("dp:2, fsdp:2,tp:2", 8)
  assert (p.degree("dp"), p.degree("fsdp"), p.degree("tp"), p.degree("pp")) == (2, 2, 2, 1)
  assert p.axis_sizes["data"] == 2 and p.axis_sizes["tensor"] == 2 and p.axis_sizes["stage"] == 1
  assert p.batch_shards == 4 and p.num_devices == 8
  assert str(par.parse_parallelism("tp:4")) == "tp:4"
  assert par.parse_parallelism("dp:2,ep:4", 8).batch_shards == 8  # EP splits the batch too


@pytest.mark.parametrize("text,match", [
    ("dp:3", "must multiply to 8"),
    ("dp:2,dp:4", "twice"),
    ("mp:8", "bad --parallelism item"),
    ("dp=two", "bad --parallelism item"),
    ("pp:0,dp:8", "must be >= 1"),
])
def test_parse_errors_are_one_line(text, match):
  with pytest.raises(par.ParallelismError, match=match) as e:
    par.parse_parallelism(text, 8)
  assert "\n" not in str(e.value)


def test_rules_table():
  rules = dict(par.RULES)
  assert rules["batch"] == ("data", "fsdp", "expert")  # EP splits the batch outside the experts
  assert rules["experts"] == ("expert",)
  assert rules["embed"] == ("fsdp",)
  for name in ("heads", "kv_heads", "mlp", "vocab", "act_heads", "act_mlp", "act_vocab"):
    assert rules[name] == ("tensor",), name
  for name in ("norm", "head_dim", "act_embed", "pos"):
    assert rules[name] is None, name
  # Pipeline and context parallelism: in the vocabulary and mapped, run by microbench.models.pipeline/context.
  assert {"stage", "expert", "context"} <= set(par.MESH_AXES)
  assert rules["layers"] == ("stage",) and rules["act_seq"] == ("context",)
  assert par.spec_for(("batch", None, "act_vocab")) == jax.P(("data", "fsdp", "expert"), None, "tensor")
  assert par.spec_for(("embed", "mlp")) == jax.P("fsdp", "tensor")
  with pytest.raises(KeyError):
    par.spec_for(("embedding",))


def test_placement_orders_and_description():
  p = par.parse_parallelism("dp:2,tp:4", 8)
  inner, outer = par.axis_order("tp_inner", p), par.axis_order("tp_outer", p)
  assert inner[-1] == "tensor" and outer[0] == "tensor"
  topo = Topology(racks=1, nodes=2, gpus=4)
  d_in = par.describe_placement(p, inner, topo)
  assert d_in["tensor"].endswith("inside a node (scale-up)") and "across 2 nodes" in d_in["data"]
  d_out = par.describe_placement(p, outer, topo)
  assert "across" in d_out["tensor"] and d_out["data"].endswith("inside a node (scale-up)")
  assert par.axis_order("tensor,data", p)[-2:] == ("tensor", "data")
  with pytest.raises(par.ParallelismError, match="leaves out tensor"):
    par.axis_order("data", p)
  with pytest.raises(par.ParallelismError, match="bad --placement"):
    par.axis_order("gpu,data", p)


def test_tensor_axis_is_device_contiguous():
  p = par.parse_parallelism("dp:2,fsdp:2,tp:2", 8)
  devs = jax.devices()[:8]
  mesh = par.build_mesh(p, devs, par.axis_order("tp_inner", p))
  grid = mesh.devices.reshape(2, 2, 2)  # data, fsdp, tensor (size-1 axes dropped)
  assert [d.id for d in grid[0, 0]] == [devs[0].id, devs[1].id]
  mesh = par.build_mesh(p, devs, par.axis_order("tp_outer", p))
  assert mesh.axis_names[0] == "tensor"
  assert [d.id for d in mesh.devices.reshape(2, 4)[:, 0]] == [devs[0].id, devs[4].id]


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_parameter_shardings_follow_rules(family):
  assert jax.device_count() >= 8, "needs 8 CPU devices (JAX_NUM_CPU_DEVICES=8)"
  p = par.parse_parallelism("dp:2,fsdp:2,tp:2", 8)
  mesh = par.build_mesh(p, jax.devices()[:8], par.axis_order("tp_inner", p))
  trainer = Trainer(get_model(family, "tiny", seq_len=16), mesh, jnp.float32, adamw(), batch=8)
  params, _, opt_state = trainer.init_state()
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  abstract = dict(jax.tree_util.tree_flatten_with_path(trainer.abstract_params,
                                                      is_leaf=lambda x: isinstance(x, nnx.Variable))[0])
  for path, v in flat:
    names = abstract[path].get_metadata()["out_sharding"]
    assert v[...].sharding.spec == par.spec_for(names), path
  # Blocks are stacked along a leading `layers` dimension (mapped to the pipeline `stage` axis, size 1 here).
  block = params["blocks"]["layers"]
  assert block["attn"]["wq"][...].sharding.spec == jax.P("stage", "fsdp", "tensor", None)
  assert block["attn"]["wo"][...].sharding.spec == jax.P("stage", "tensor", None, "fsdp")
  assert block["mlp"]["w_up"][...].sharding.spec == jax.P("stage", "fsdp", "tensor")  # column split
  assert block["mlp"]["w_down"][...].sharding.spec == jax.P("stage", "tensor", "fsdp")  # row split
  assert params["embed"][...].sharding.spec == jax.P("tensor", "fsdp")
  w_up = block["mlp"]["w_up"][...]
  assert w_up.shape[0] == 2  # the tiny models' two layers
  assert w_up.addressable_shards[0].data.shape == (2, w_up.shape[1] // 2, w_up.shape[2] // 2)
  # FSDP shards the optimizer state with its parameter.
  mu_w_up = opt_state[-1][0].mu["blocks"]["layers"]["mlp"]["w_up"][...]
  assert mu_w_up.sharding.spec == jax.P("stage", "fsdp", "tensor")
  if family == "llama3":
    assert params["head"][...].sharding.spec == jax.P("fsdp", "tensor")
    assert block["attn"]["wk"][...].sharding.spec == jax.P("stage", "fsdp", "tensor", None)
