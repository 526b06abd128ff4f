"""Golden communication fingerprints (like MaxText's sharding dumps): per (model, strategy) on 8 CPU devices,
and per study preset (--preset=study-*, resolved for 8 CPU devices), the collectives of the compiled training
step (AdamW with clipping, the runner's defaults) — count, bytes and element types per step, and per iteration
of each loop with its trip count — diffed against tests/golden/comm_fingerprints.json. A change in what a
strategy communicates, intended or not, shows here.

Regenerate after an intended change (and read the diff): `python -m pytest tests/test_golden_comm.py
--update-golden` (or MICROBENCH_UPDATE_GOLDEN=1). The file records the JAX version it was made with; XLA
upgrades may legitimately change combining and layouts.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from _trainers import FAST, compiled_step, make_trainer  # noqa: E402
from microbench import train  # noqa: E402
from microbench.study import presets  # noqa: E402
from microbench.train.comm_fingerprint import comm_report  # noqa: E402
from microbench.models.layers import Execution  # noqa: E402
from microbench.models.optimizer import adamw  # noqa: E402
from microbench.models.train_step import Trainer  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "comm_fingerprints.json")

# (model, strategy, extra): tiny shapes, batch 8, 32 tokens (ViT/ResNet: their images), float32.
CASES = [
    ("gpt2", "dp:8", {}),
    ("gpt2", "fsdp:8", {}),
    ("gpt2", "dp:2,tp:4", {}),
    ("gpt2", "fsdp:2,tp:4", {}),
    ("gpt2", "dp:2,fsdp:2,tp:2", {}),
    ("gpt2", "fsdp:8", {"dtype": "bfloat16"}),
    ("gpt2", "dp:2,fsdp:2,tp:2", {"grad_accum": 2}),
    ("llama3", "fsdp:4,tp:2", {}),
    ("llama3", "dp:2,fsdp:2,tp:2", {}),
    ("vit", "dp:2,fsdp:2,tp:2", {}),
    ("resnet", "dp:8", {}),
    ("resnet", "fsdp:8", {}),
]


# Pipeline, expert and context parallelism (the study's composites are the presets below).
CASES += [
    ("gpt2", "dp:2,pp:4", {"microbatches": 4, "schedule": "1f1b", "layers": 4}),
    # bfloat16 through the pipeline (a bfloat16 psum there once crashed XLA:CPU's compiler)
    ("llama3", "dp:2,pp:2,tp:2", {"microbatches": 2, "dtype": "bfloat16"}),
    ("llama3", "fsdp:2,tp:2,cp:2", {"context_impl": "ring"}),
    ("gpt2", "fsdp:2,tp:2,cp:2", {"context_impl": "all_to_all"}),
]
PRESETS = list(presets.PRESETS)


def _key(model: str, strategy: str, extra: dict) -> str:
  return " ".join([f"{model}-tiny", strategy] + [f"{k}={v}" for k, v in sorted(extra.items())])


def _report(t: Trainer) -> dict:
  report = comm_report(compiled_step(t).as_text(), t.mesh.size)
  return {"ops": report["ops"],
          "loops": [{"trip_count": lp["trip_count"], "ops": lp["ops"]} for lp in report["loops"]]}


def _fingerprint(model: str, strategy: str, extra: dict) -> dict:
  kw = dict(extra)
  if "dtype" in kw:
    kw["dtype"] = jnp.dtype(kw["dtype"])
  how = {k: kw.pop(k) for k in ("microbatches", "schedule", "context_impl") if k in kw}
  if how:
    kw["execution"] = Execution(**how)
  return _report(make_trainer(model, strategy, tx=adamw(), **kw))


def _preset_fingerprint(name: str) -> dict:
  """The step `microbench-train --preset=name` compiles on 8 CPU devices."""
  fields, _ = presets.resolve(name, 8, "cpu", None, {})
  cfg = train.TrainConfig(**fields, write=False, verbose=False, compiler_options=FAST)
  p = train.plan(cfg, jax.devices()[:8])
  return _report(Trainer(p.spec, p.mesh, jnp.float32, adamw(), cfg.batch, execution=p.execution()))


@pytest.fixture(scope="module")
def golden(update_golden):
  if update_golden or not os.path.exists(GOLDEN):
    current = {_key(*c): _fingerprint(*c) for c in CASES}
    current.update({f"preset {name}": _preset_fingerprint(name) for name in PRESETS})
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
      json.dump({"jax": jax.__version__, "devices": "8 CPU", "fingerprints": current}, f, indent=1, sort_keys=True)
      f.write("\n")
    if not update_golden:
      pytest.fail(f"{GOLDEN} was missing and has been written; check it in (rerun to compare)")
  with open(GOLDEN) as f:
    return json.load(f)


def test_golden_file_covers_every_case(golden):
  assert sorted(golden["fingerprints"]) == sorted([_key(*c) for c in CASES] + [f"preset {n}" for n in PRESETS])


@pytest.mark.slow
@pytest.mark.parametrize("model,strategy,extra", CASES, ids=[_key(*c) for c in CASES])
def test_comm_fingerprint_matches_golden(golden, model, strategy, extra):
  want = golden["fingerprints"][_key(model, strategy, extra)]
  got = json.loads(json.dumps(_fingerprint(model, strategy, extra)))  # the file's types (str keys, lists)
  assert got == want, (
      f"{_key(model, strategy, extra)}: the compiled step's collectives changed (jax {jax.__version__}, golden"
      f" made with {golden['jax']}).\n got  {json.dumps(got, sort_keys=True)}\n want {json.dumps(want, sort_keys=True)}\n"
      "If intended, regenerate: python -m pytest tests/test_golden_comm.py --update-golden")


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_comm_fingerprint_matches_golden(golden, name):
  want = golden["fingerprints"][f"preset {name}"]
  got = json.loads(json.dumps(_preset_fingerprint(name)))
  assert got == want, (
      f"--preset={name}: the compiled step's collectives changed (jax {jax.__version__}, golden made with"
      f" {golden['jax']}).\n got  {json.dumps(got, sort_keys=True)}\n want {json.dumps(want, sort_keys=True)}\n"
      "If intended, regenerate: python -m pytest tests/test_golden_comm.py --update-golden")


def test_a_changed_strategy_fails_the_diff(golden):
  """The diff is not blind: the fsdp:8 program differs from the dp:8 golden in every op."""
  fsdp = json.loads(json.dumps(_fingerprint("gpt2", "fsdp:8", {})))
  assert fsdp != golden["fingerprints"][_key("gpt2", "dp:8", {})]
  assert fsdp == golden["fingerprints"][_key("gpt2", "fsdp:8", {})]
