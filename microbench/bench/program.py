"""One benchmark point's programs: build them, check the result, time them.

- The **check program** runs the collective once on known inputs (microbench.bench.known_inputs); every
  output element is compared exactly with the expectation. In latency mode (`--iters=1`) it is also what is
  timed, one operation per call.
- The **timed programs** repeat the collective in a `fori_loop` whose bound is a Python int, so the compiled
  `while` carries XLA's `known_trip_count` and the repetitions run back to back on the device (on GPUs a
  loop without one copies its condition to the host and synchronises every iteration). The loop body is two
  repetitions (`Collective.step` twice): the first's output lands in a temporary, the second's in the carry
  the first freed, so no repetition copies the S buffer. The carry is donated and aliased to the output, so
  a call allocates no fresh S buffer either.
- **Every repetition is checked**: each timed program has a checked twin, the same step with every
  repetition's output folded into a digest (each element's bits mixed with its position by a bijective
  32-bit hash, summed in uint32) in a 4-byte accumulator in the carry, acc = acc x MUL + digest. The twins
  run untimed before the samples (`untimed_calls`): the long arm's at least once, the short arm's once, and the
  long arm's again until the digested repetitions span a whole period of the chain (a ring shift: the group
  size), so every state a repetition can start from is digested once. The samples then run the plain
  programs, so the final carry is theirs. After the timed calls the accumulator and the final carry's digests
  are compared with what the known buffers give: the check program's output (verified element by element)
  and the known inputs, `Collective.rep_output` saying which one each repetition must reproduce. Where no
  known buffer holds a repetition's output (a chained sum grows n-fold a repetition and rounds), the twin
  (`Collective.compared_to_op`) the digests the twins must give come from the check program itself, run
  repetition after repetition on its own outputs from the known inputs (`chain_digests`: an operation verified
  exactly, compiled apart from the timed programs), and each plain program is replayed from the known inputs
  beside its twin, their final outputs compared (`replay_check`). A repetition that added 1, moved nothing or corrupted one
  element changes its digest, and MUL is odd, so no later one undoes it.
- **Time by difference**: the short arm runs `SHORT_REPS` = 2 operations (one trip, which XLA inlines:
  two operations back to back), the long arm k2 >= 6 (a loop of k2/2 trips). Samples alternate between the
  arms; each pair gives (T(k2) - T(2)) / (k2 - 2) per operation, which cancels everything paid once per call
  (dispatch, launch, the first operation's wait for its peers, per-call buffers) instead of charging it to
  the operation.

Barriers sit outside the timed region; compile time is measured separately.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from microbench.meshes.scopes import ScopePlan
from microbench.bench import command_buffer as cmdbuf
from microbench.bench import device_inputs, hlo_check, known_inputs
from microbench.bench.collectives import BITS, Collective

CHECK_CHUNK = 1 << 22  # elements compared at a time: host memory for the check stays small
SHORT_REPS = 2         # operations in the short arm
MIN_LONG_REPS = 6      # the long arm: a real loop (>= 2 trips), and 4 operations more than the short one

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32,
          "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}


as_dtype = known_inputs.as_dtype  # also the name the bench's callers use


def platform_of(mesh: jax.sharding.Mesh) -> str:
  return mesh.devices.flat[0].platform


@dataclasses.dataclass
class Compiled:
  """One compiled program of a point and what its HLO check found."""
  fn: Callable
  hlo_text: str
  verified: hlo_check.Verified
  reps: int  # operations per call
  # The checked twin: the same step with every repetition's output digested, run untimed before the samples
  # (untimed_calls); None for the twin itself and where none was built (a compile-only target).
  checked: "Compiled | None" = None


@dataclasses.dataclass
class Point:
  """The programs of one point and the arrays they run on."""
  collective: Collective
  scope: ScopePlan
  dtype: str
  count: int  # elements of the S buffer per rank
  mesh: jax.sharding.Mesh
  check_prog: Compiled
  x: jax.Array | None = None  # known inputs (the check program does not consume them)
  x_digests: jax.Array | None = None  # every rank's digest of `x`, [devices], made with it
  # [devices, len(BUFFERS)] uint32 by mesh position: the digests of each rank's known buffers (BUFFERS: its known
  # input, its check output (check run 0, verified element by element), and where the collective alternates
  # inputs, the second set and its check output): what the timed repetitions must reproduce
  digests: np.ndarray | None = None
  wrong_at: list[dict] = dataclasses.field(default_factory=list)  # this process's first wrong element per rank
  _where: jax.Array | None = None

  @property
  def n(self) -> int:
    return self.scope.group_size

  def inputs(self) -> jax.Array:
    """The known inputs on the devices, made on first use and kept until a timed program consumes them."""
    if self.x is None:
      self.x = known_input_array(self)
      self.x_digests = _digest_all(self.mesh)(self.x)
    return self.x

  @property
  def platform(self) -> str:
    return platform_of(self.mesh)

  def where(self) -> jax.Array:
    """Each device's (group index, group rank), on the devices (made once per point)."""
    if self._where is None:
      self._where = device_inputs.where_array(self.mesh, self.scope.groups)
    return self._where

  @property
  def in_count(self) -> int:
    return self.collective.in_count(self.count, self.n)

  @property
  def out_count(self) -> int:
    return self.collective.out_count(self.count, self.n)

  @property
  def wire_dtype(self) -> str:
    return self.check_prog.verified.wire_dtype

  @property
  def check_runs(self) -> int:
    """Check runs with differently seeded inputs that together catch every single-rank error."""
    return known_inputs.check_runs(self.collective.inputs, self.dtype, self.n, self.in_count)

  def group_inputs(self, run: int = 0) -> list[known_inputs.GroupInputs]:
    return [known_inputs.group_inputs(self.collective.inputs, self.dtype, self.n, gi, self.in_count, run)
            for gi in range(self.scope.num_groups)]


def _global_array(mesh: jax.sharding.Mesh, per_rank: int, fill: Callable[[int], np.ndarray], dtype) -> jax.Array:
  """A [devices * per_rank] array sharded over every mesh axis; `fill(position)` gives one device's part."""
  sharding = jax.NamedSharding(mesh, jax.P(mesh.axis_names))

  def cb(index):
    sl = index[0]
    start = sl.start or 0
    stop = sl.stop if sl.stop is not None else mesh.size * per_rank
    parts = [fill(p) for p in range(start // per_rank, stop // per_rank)]
    return np.concatenate(parts).astype(np.dtype(dtype)) if parts else np.empty(0, np.dtype(dtype))

  return jax.make_array_from_callback((mesh.size * per_rank,), sharding, cb)


def _where(scope: ScopePlan) -> dict[int, tuple[int, int]]:
  """Mesh position -> (group index, group rank)."""
  return {int(p): (gi, r) for gi, g in enumerate(scope.groups) for r, p in enumerate(g)}


BUFFERS = ("in", "out", "alt_in", "alt_out")  # the known buffers a repetition's output or a final slot is named by


def family_of(point: Point, run: int = 0, alt: bool = False) -> device_inputs.Family:
  """The known inputs of check run `run` (`alt`: the second set, known_inputs.alt_shift)."""
  shift = known_inputs.alt_shift(point.dtype) if alt else 0
  return device_inputs.Family(point.collective.inputs, point.dtype, point.n, point.in_count, run, shift)


def known_input_array(point: Point, run: int = 0, alt: bool = False) -> jax.Array:
  """The known inputs of check run `run` (`alt`: the second set), built on the devices (device_inputs):
  nothing of the message's size crosses from the host."""
  return device_inputs.inputs(point.mesh, family_of(point, run, alt), point.where(), point.in_count)


def known_input_array_host(point: Point, run: int = 0) -> jax.Array:
  """The same inputs built on the host from known_inputs (the specification; tests compare the two)."""
  where = _where(point.scope)
  inputs = point.group_inputs(run)

  def fill(position):
    gi, r = where[position]
    return inputs[gi].rank(r, 0, point.in_count)
  return _global_array(point.mesh, point.in_count, fill, DTYPES[point.dtype])


def _spec(mesh: jax.sharding.Mesh, per_rank: int, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((mesh.size * per_rank,), dtype, sharding=jax.NamedSharding(mesh, jax.P(mesh.axis_names)))


def expectation(coll: Collective, scope: ScopePlan, count: int, dtype: str, platform: str, reps: int,
                timed: bool, twin: bool = False) -> hlo_check.Expectation:
  """What a point's program must compile to: the check program (one operation), a timed program (`reps`
  operations in a loop) or its checked `twin` (the same, digested: never timed, so its writes are reported and
  none fails)."""
  op = coll.hlo_expect(platform)
  n = scope.group_size
  message = max(2, min(coll.in_count(count, n), coll.out_count(count, n)))
  return hlo_check.Expectation(
      op=op, groups=coll.hlo_groups(scope.groups), ordered=coll.ordered_groups and op != "all-reduce", dtype=dtype,
      elements=coll.op_elements(count, n), executions=reps,
      in_loop=timed and reps > SHORT_REPS, outside_max=2 if timed else 0,
      # At least 2: the feedback writes one element per repetition, which on a 1-element shard is the message.
      # In place, the one-operation program is read too: whether XLA ran the op in its input's buffer.
      copy_limit=message if timed or coll.inplace else None, strict_writes=not twin,
      widen_ok=platform == "cpu", bits_ok=coll.moves_bits(platform),
      # XLA:CPU's tuple all-to-all, the masked all-reduce standing in for a broadcast and the float32 converts
      # around a widened 16-bit collective write the message next to the collective as part of the op there
      # (GPUs run the array form, collective-broadcast and 16-bit wires: checked strictly).
      # avg's multiplication by 1/n writes the output once more on every platform: part of the op.
      # XLA:TPU's masked all-reduce standing in for a broadcast selects the message as XLA:CPU's does, and its
      # small all-to-alls re-tile the message around the op (a reshape to [n, count/n, 1] and a reduce back).
      writes_are_the_op=coll.writes_message or platform == "tpu" and (
          op == "all-reduce" and coll.hlo_op == "collective-broadcast" or op == "all-to-all") or platform == "cpu" and (
          coll.hlo_op in ("all-to-all", "collective-broadcast", "ragged-all-to-all")
          or dtype in ("bfloat16", "float16", *known_inputs.FP8)),
      aliased=coll.inplace, onchip_staging=platform == "tpu", rewrites=_tpu_rewrites(coll, count, n, platform),
      tables=n if op == "ragged-all-to-all" else None,
      slice_devices=slice_devices(scope, platform))


def slice_devices(scope: ScopePlan, platform: str) -> int | None:
  """Chips per slice when the devices are several TPU slices (hlo_check.Expectation.slice_devices), else None."""
  if platform != "tpu" or scope.slice_devices is None:
    return None
  return scope.slice_devices


def _tpu_rewrites(coll: Collective, count: int, n: int, platform: str) -> tuple[tuple[str, int], ...]:
  """XLA:TPU's own forms of an op (hlo_check.Expectation.rewrites): an all-gather as an all-reduce of the
  zero-padded output, a reduce-scatter as an all-reduce of the whole input (then sliced)."""
  if platform != "tpu":
    return ()
  if coll.hlo_op == "all-gather":
    return (("all-reduce", coll.out_count(count, n)),)
  if coll.hlo_op == "reduce-scatter":
    return (("all-reduce", coll.in_count(count, n)),)
  return ()


def _compile(fn: Callable, specs: list, donate: bool, command_buffer: cmdbuf.Arm | None = None
             ) -> tuple[Callable, str, str | None]:
  """The compiled program, its HLO text and, where the arm asks for it, XLA:GPU's thunk sequence (command
  buffers are formed after the HLO). Without `command_buffer` XLA's own default applies (CPU: none exist)."""
  lowered = jax.jit(fn, donate_argnums=tuple(range(len(specs))) if donate else ()).lower(*specs)
  if command_buffer is None:
    compiled, thunk_text = lowered.compile(), None
  else:
    compiled, thunk_text = cmdbuf.compile_lowered(lowered, command_buffer)
  return compiled, compiled.as_text(), thunk_text


def _placed(verified: hlo_check.Verified, thunk_text: str | None, arm: cmdbuf.Arm | None,
            exp: hlo_check.Expectation) -> hlo_check.Verified:
  """`verified` with where its collective (and timed loop) runs as to command buffers, checked against the
  arm (unchanged where the arm reads no thunk sequence)."""
  if arm is None or not arm.check:
    return verified
  return hlo_check.verify_command_buffer(verified, thunk_text, arm.on, loop=exp.in_loop)


def build_check(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str,
                verify: Callable[[str, hlo_check.Expectation], hlo_check.Verified] = hlo_check.verify,
                command_buffer: cmdbuf.Arm | None = None) -> Point:
  """Compiles the one-operation program and checks its HLO (raises hlo_check.HloMismatch); `verify` is
  replaceable for tests whose deliberately wrong collectives need their own HLO expectation; `command_buffer`:
  XLA:GPU's command buffers for it (None: XLA's default)."""
  n, platform = scope.group_size, platform_of(mesh)
  fn = jax.shard_map(lambda x: coll.op(x, scope.axes, n, platform), mesh=mesh, in_specs=jax.P(mesh.axis_names),
                     out_specs=jax.P(mesh.axis_names), check_vma=False)
  exp = expectation(coll, scope, count, dtype, platform, 1, timed=False)
  compiled, text, thunk_text = _compile(fn, [_spec(mesh, coll.in_count(count, n), DTYPES[dtype])],
                                        donate=coll.inplace, command_buffer=command_buffer)
  verified = _placed(verify(text, exp), thunk_text, command_buffer, exp)
  return Point(coll, scope, dtype, count, mesh, Compiled(compiled, text, verified, 1))


# The ring cost of the form XLA:TPU writes an all-gather or a reduce-scatter in (an all-reduce of the whole buffer:
# 2 (n-1)/n of it per rank) over the op's own ((n-1)/n): what each byte of the op costs on the links there.
WIRE_FACTOR = {"all-gather as all-reduce": 2.0, "reduce-scatter as all-reduce": 2.0}


def form(coll: Collective, count: int, n: int, prog: Compiled) -> dict:
  """What the platform's form of the op adds to what a point measures, from a program's HLO check: the form XLA
  wrote the op in and its link traffic over the op's own (`wire_factor`), elements packed into wider words,
  and the message-sized HBM writes besides the collective per operation (`hbm_passes_per_op`: re-tiling, a
  split op's merge, a padded buffer, XLA:CPU's tuple all-to-all). Empty where the op is just itself."""
  v, out = prog.verified, {}
  if v.written_as:
    out.update(written_as=v.written_as, wire_factor=WIRE_FACTOR.get(v.written_as, 1.0))
  if v.packed_in:
    out["packed_in"] = v.packed_in
  if v.unaliased:
    out["out_of_place"] = "in place asked; XLA gave the result its own buffer"
  if v.form_writes:
    out["hbm_passes_per_op"] = round(v.form_writes / max(1, v.executions) / max(1, coll.op_elements(count, n)), 3)
  return out


def carry_counts(coll: Collective, in_count: int, out_count: int, dtype: str, platform: str) -> list[int]:
  """Elements per rank of each data slot of the timed carry (the digest accumulator comes after them)."""
  shapes = jax.eval_shape(lambda x: coll.carry(x, out_count, platform),
                          jax.ShapeDtypeStruct((in_count,), DTYPES[dtype]))
  return [int(s.shape[0]) for s in shapes]


DIGEST_MUL = 0x01000193  # odd: acc -> acc x MUL + d is a bijection mod 2^32, so no later digest undoes a wrong one
_GOLDEN = 0x9E3779B9
_SEED = 0x2545F491
_FMIX = (0x85EBCA6B, 0xC2B2AE35)  # MurmurHash3's 32-bit finaliser
DIGEST_SCOPE = "microbench_digest"  # names the digest's instructions in the HLO (read in tests)


def mix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser on uint32: a bijection of 2^32 whose every output bit depends on every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(_FMIX[0])
  h = h ^ (h >> 13)
  h = h * jnp.uint32(_FMIX[1])
  return h ^ (h >> 16)


def digest(y: jax.Array) -> jax.Array:
  """[1] uint32: the sum over i of mix32(bits(y_i) + i x golden + seed), mod 2^32.

  - One wrong element always changes it: for a fixed position, bits -> mix32(bits + key) is a bijection, and
    the other terms stay.
  - Any other error (several elements, a shift, a swap, +1 on every element of a run of consecutive integers)
    changes the sum by a difference of mixed terms that no structure of the inputs lines up: it goes unseen
    with probability about 2^-32, the chance that a random 32-bit value is 0 (mix32's outputs behave as
    random; tests replay the structured errors a plain keyed sum missed, thousands of times, and none
    collides).
  - Integer addition mod 2^32 gives the same sum in any order on any device.

  Only the checked twins and the check's helpers digest (never a timed program), so its cost is never
  measured."""
  with jax.named_scope(DIGEST_SCOPE):
    bits = jax.lax.bitcast_convert_type(y, BITS[y.dtype.itemsize])
    key = jax.lax.iota(jnp.uint32, y.shape[0]) * jnp.uint32(_GOLDEN) + jnp.uint32(_SEED)
    return jnp.sum(mix32(bits.astype(jnp.uint32) + key), dtype=jnp.uint32).reshape(1)


def fold(acc: jax.Array, y: jax.Array) -> jax.Array:
  """The accumulator after one more repetition whose output is y."""
  return acc * jnp.uint32(DIGEST_MUL) + digest(y)


def build_timed(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str,
                reps: int, command_buffer: cmdbuf.Arm | None = None, twin: bool = True) -> Compiled:
  """Compiles the program that runs `reps` (even) operations back to back and, as its `checked` twin, the same
  program digesting every repetition's output; checks both HLOs. The timed calls run the first: the digest
  is one more pass over each output, which on CPU costs 1.2-5x the collective itself (scripts/bench_peer.py's
  figures), so it is never timed. `twin=False` (a compile-only target, where nothing runs to be checked): the
  timed program alone. Both arms, short and long, have a twin."""
  timed = _build_timed(coll, mesh, scope, count, dtype, reps, digest=False, command_buffer=command_buffer)
  if twin:
    timed.checked = build_twin(coll, mesh, scope, count, dtype, reps, command_buffer)
  return timed


def build_twin(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str, reps: int,
               command_buffer: cmdbuf.Arm | None = None) -> Compiled | None:
  """The checked twin of build_timed's program alone (a sweep compiles the two side by side)."""
  return _build_timed(coll, mesh, scope, count, dtype, reps, digest=True, command_buffer=command_buffer)


_TRACING: contextvars.ContextVar[tuple[int, bool] | None] = contextvars.ContextVar("tracing", default=None)


def tracing() -> tuple[int, bool] | None:
  """While a timed program's step is traced: (its operations, whether it is the checked twin); None while the
  check program is (a collective whose step depends on it is one the check must catch: microbench.bench.mutants)."""
  return _TRACING.get()


def _build_timed(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str,
                 reps: int, digest: bool, command_buffer: cmdbuf.Arm | None = None) -> Compiled:
  if reps % 2 or reps < SHORT_REPS:
    raise ValueError(f"timed programs run an even number >= {SHORT_REPS} of operations, not {reps}")
  token = _TRACING.set((reps, digest))
  try:
    return _build_timed_traced(coll, mesh, scope, count, dtype, reps, digest, command_buffer)
  finally:
    _TRACING.reset(token)


def _build_timed_traced(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str,
                        reps: int, digest: bool, command_buffer: cmdbuf.Arm | None) -> Compiled:
  n, platform = scope.group_size, platform_of(mesh)
  counts = carry_counts(coll, coll.in_count(count, n), coll.out_count(count, n), dtype, platform)

  def one(c):
    slots, y = coll.step(c[:-1], scope.axes, n, platform)
    if not digest:
      return (*slots, c[-1])
    return (*slots, fold(c[-1], y))

  def per_device(*carry):
    return timed_loop(coll, one, reps, tuple(carry))

  specs = [_spec(mesh, c, DTYPES[dtype]) for c in counts] + [_spec(mesh, 1, jnp.uint32)]
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(jax.P(mesh.axis_names) for _ in specs),
                     out_specs=tuple(jax.P(mesh.axis_names) for _ in specs), check_vma=False)
  exp = expectation(coll, scope, count, dtype, platform, reps, timed=True, twin=digest)
  compiled, text, thunk_text = _compile(fn, specs, donate=True, command_buffer=command_buffer)
  verified = _placed(hlo_check.verify(text, exp), thunk_text, command_buffer, exp)
  return Compiled(compiled, text, verified, reps)


def timed_loop(coll: Collective | None, step: Callable, reps: int, carry):
  """The timed programs' loop for `coll`: two repetitions per trip (`repeat`), or one for an in-place collective,
  whose output must land in the buffer it read (the carry's)."""
  if coll is not None and coll.inplace:
    return jax.lax.fori_loop(0, reps, lambda _, c: step(c), carry)
  return repeat(step, reps, carry)


def repeat(step: Callable, reps: int, carry):
  """`reps` (even) applications of `step`, two per trip of a `fori_loop` with Python bounds: XLA knows
  the trip count, and the second step writes into the buffer the first one freed."""
  return jax.lax.fori_loop(0, reps // 2, lambda _, c: step(step(c)), carry)


def initial_carry(point: Point) -> tuple[jax.Array, ...]:
  """The timed programs' first carry, as Collective.slot_sources says: the known inputs (and the second set),
  output slots filled with known_inputs.FILL (not the check's output: a repetition that failed to write an
  element would keep a right value), the accumulator at 0."""
  coll, dt = point.collective, DTYPES[point.dtype]
  counts = carry_counts(coll, point.in_count, point.out_count, point.dtype, point.platform)
  slots = []
  for source, c in zip(coll.slot_sources(point.platform), counts):
    if source == "in":
      slots.append(point.inputs())
      point.x = None  # the first timed call consumes it
    elif source == "alt_in":
      slots.append(known_input_array(point, alt=True))
    elif source == "zero":
      slots.append(_zeros(point.mesh, c, dt)())
    else:
      slots.append(_zeros(point.mesh, c, dt, known_inputs.FILL[point.dtype])())
  return (*slots, _zeros(point.mesh, 1, jnp.uint32)())


@functools.lru_cache(maxsize=16)
def _zeros(mesh: jax.sharding.Mesh, per_rank: int, dtype, value: int = 0) -> Callable[[], jax.Array]:
  """`value` (zeros by default) in [devices x per_rank], made on the devices (from the host, a 64 MiB slot took
  seconds a point)."""
  return jax.jit(lambda: jnp.full((mesh.size * per_rank,), value, dtype),
                 out_shardings=jax.NamedSharding(mesh, jax.P(mesh.axis_names)))


def check(point: Point, compare: bool = True) -> int:
  """Runs the check program on known inputs, once per check run (known_inputs.check_runs: more than one
  only where one run's inputs can't expose every single-rank error); returns this process's count of wrong
  output elements over the runs.

  With `compare=False` the first run still happens (the first execution, with its one-time costs) but the
  output is not compared. A collective whose repetitions alternate two sets of inputs (Collective.alt_inputs)
  is checked on the second set too; the digests of both sets and their outputs fill `point.digests`.
  """
  if not compare:
    run_check_program(point, point.inputs())
    return 0
  wrong = 0
  table = np.zeros((point.mesh.size, len(BUFFERS)), np.int64)
  for run in range(point.check_runs):
    x = point.inputs() if run == 0 else known_input_array(point, run)
    x_digests = point.x_digests if run == 0 else None  # made with x, before an in-place call consumes it
    y = run_check_program(point, x)
    if run == 0:  # the output's digests come from the comparison's own read of it
      count, y_digests = compare_output(point, y, run, digested=True)
      table[:, 0], table[:, 1] = np.asarray(x_digests), np.asarray(y_digests)
    else:
      count = compare_output(point, y, run)
    wrong += count
  if point.collective.alt_inputs:
    x = known_input_array(point, alt=True)
    x_digests = _digest_all(point.mesh)(x)
    count, y_digests = compare_output(point, run_check_program(point, x), digested=True, alt=True)
    table[:, 2], table[:, 3] = np.asarray(x_digests), np.asarray(y_digests)
    wrong += count
  point.digests = table
  return wrong


def helper_compiles(coll: Collective, mesh: jax.sharding.Mesh, scope: ScopePlan, count: int, dtype: str,
                    wire_dtype: Callable[[], str] | None = None) -> list[Callable[[], None]]:
  """A point's helper programs (the inputs' generator and digest, the timed carry's zeros and, given
  `wire_dtype`, the comparison and the final digests), each as a job that compiles it for the point's shapes
  before its first call: a sweep runs them beside the point's own compiles (the calls later find them in jit's
  cache), where one after another at their first call they took seconds of every sweep's check.
  `wire_dtype` waits for the check program's HLO (the comparison rounds as it does). The arrays the helpers
  take (the family's tables, each device's place) are put on the devices here, in the caller's thread: in a
  multi-process job a device_put is a collective, and every process must issue its collectives in one order
  (put from the compile threads, two processes deadlocked)."""
  n, platform, dt = scope.group_size, platform_of(mesh), DTYPES[dtype]
  in_count, out_count = coll.in_count(count, n), coll.out_count(count, n)
  families = [device_inputs.Family(coll.inputs, dtype, n, in_count)]
  if coll.alt_inputs:
    families.append(device_inputs.Family(coll.inputs, dtype, n, in_count, 0, known_inputs.alt_shift(dtype)))
  where = device_inputs.where_array(mesh, scope.groups)
  for family in families:
    device_inputs.device_tables(mesh, family)
  counts = carry_counts(coll, in_count, out_count, dtype, platform)
  fill = known_inputs.FILL[dtype]
  jobs = [functools.partial(lambda f: device_inputs.precompile(mesh, coll, f, where, out_count, in_count, n, None), f)
          for f in families]
  jobs += [lambda: _digest_all(mesh).lower(_spec(mesh, in_count, dt)).compile(),
           lambda: _zeros(mesh, 1, jnp.uint32).lower().compile()]
  # the output slots start filled with known_inputs.FILL
  jobs += [functools.partial(lambda c: _zeros(mesh, c, dt, fill).lower().compile(), c)
           for c, source in set(zip(counts, coll.slot_sources(platform))) if source == "fill"]
  if wire_dtype is not None:
    jobs += [functools.partial(lambda f: device_inputs.precompile(mesh, coll, f, where, out_count, in_count, n,
                                                                  wire_dtype(), digest), f) for f in families]
    # the timed check's digests of the final carry: one program per slot length, the inputs' is above
    jobs += [functools.partial(lambda c: _digest_all(mesh).lower(_spec(mesh, c, dt)).compile(), c)
             for c in set(counts) - {in_count}]
  return jobs


def run_check_program(point: Point, x: jax.Array) -> jax.Array:
  """One call of the check program on `x`, finished. In place, `x` is donated (gone after the call): the
  output stands in for the point's inputs until they are made again."""
  y = point.check_prog.fn(x)
  jax.block_until_ready(y)
  if point.collective.inplace and point.x is x:
    point.x = None
  return y


def expected_acc(sequence: list[int], reps: int) -> int:
  """The accumulator after `reps` repetitions from 0 whose digests repeat `sequence` (its period): one
  period is an affine map mod 2^32, raised to the number of whole periods by squaring, then the rest."""
  mod, p = 1 << 32, len(sequence)
  a, b = 1, 0
  for d in sequence:
    a, b = a * DIGEST_MUL % mod, (b * DIGEST_MUL + d) % mod
  acc, m = 0, reps // p
  while m:
    if m & 1:
      acc = (a * acc + b) % mod
    a, b, m = a * a % mod, (a * b + b) % mod, m >> 1
  for d in sequence[:reps % p]:
    acc = (acc * DIGEST_MUL + d) % mod
  return acc


@functools.lru_cache(maxsize=8)
def _digest_all(mesh: jax.sharding.Mesh) -> Callable:
  """An array -> every rank's digest of its shard, [devices], on every process (a tiny all-gather: chained
  collectives repeat other ranks' inputs). Kept apart from the generator: fused with it, XLA:CPU computed the
  inputs twice (for the output and for the digest), 0.30 -> 0.68 s at 16 MiB on 8 devices."""
  def per_device(x):
    return jax.lax.all_gather(digest(x), mesh.axis_names, tiled=True)
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=jax.P(mesh.axis_names), out_specs=jax.P(), check_vma=False))


def compare_output(point: Point, y: jax.Array, run: int = 0, digested: bool = False, alt: bool = False):
  """Wrong elements of this process's shards of `y` against the expected output of check run `run` (`alt`: on
  the second set of inputs), compared on the devices (device_inputs: the expected output is generated beside
  `y`, and only a count and the first wrong index per rank come back). The ranks with wrong elements are kept
  in `point.wrong_at`. `digested`: (the count, every rank's digest of `y`), from the same read of it."""
  coll = point.collective
  family = family_of(point, run, alt)
  res = device_inputs.compare(point.mesh, coll, family, y, point.where(), point.out_count, point.in_count,
                              point.n, point.wire_dtype, digest if digested else None)
  y_digests = None
  if digested:
    res, y_digests = res
  where = _where(point.scope)
  for position, (count, first) in enumerate(res):
    if count > 0:
      gi, rank = where[position]
      point.wrong_at.append({"run": run, "group": gi, "rank": rank, "wrong": int(count), "first": int(first)})
  count = int(res[res[:, 0] > 0, 0].sum())
  return (count, y_digests) if digested else count


def compare_output_host(point: Point, y: jax.Array, run: int = 0) -> int:
  """Wrong elements of this process's shards of `y` against the expected output of check run `run`, computed
  on the host a range at a time from known_inputs (the specification; tests compare it with the device's)."""
  coll, in_count, out_count = point.collective, point.in_count, point.out_count
  where = _where(point.scope)
  inputs = point.group_inputs(run)
  wrong = 0
  for shard in y.addressable_shards:
    gi, rank = where[(shard.index[0].start or 0) // out_count]
    got = np.asarray(shard.data)
    for a in range(0, out_count, CHECK_CHUNK):
      b = min(out_count, a + CHECK_CHUNK)
      want = as_dtype(coll.expected_finished(inputs[gi], rank, in_count, a, b, point.wire_dtype), point.dtype)
      wrong += int(np.count_nonzero(got[a:b] != want))
  return wrong


def check_timed(point: Point, carry: tuple[jax.Array, ...], reps: int,
                digested: tuple[int, int] | None = None) -> tuple[int | None, str]:
  """Compares the timed programs' final carry, after `reps` repetitions in all (every untimed and timed call,
  chained from the known inputs), with what the repetitions must have produced: the digest accumulator (the
  whole output of each of the `digested` = (offset, count) repetitions the checked twins ran, in order; all
  of them by default) and the digests of the final carry's slots that a known buffer holds (a chain carries
  every repetition's output into them). Where no known buffer holds a repetition's output
  (Collective.compared_to_op), the digests each repetition must give come from `chain_digests` (the check
  program run on its own outputs), and replay_check compares the plain programs. Returns the count of this
  process's ranks whose outputs differed (None when not compared) and a note: what was compared, or why not."""
  offset, count = digested if digested is not None else (0, reps)
  if point.digests is None:
    return None, "not compared: the check program's output was not compared (--nocheck)"
  coll, n, table, platform = point.collective, point.n, point.digests, point.platform
  chain = chain_digests(point, offset + count) if coll.compared_to_op(n, platform) else None
  slots, acc = carry[:-1], carry[-1]
  named = coll.final_carry(0, reps, n, platform)
  kept = [i for i, b in enumerate(named) if b is not None]
  # [devices, slots] by mesh position: the inputs' digest program serves every slot of their length
  final = np.stack([np.asarray(_digest_all(point.mesh)(slots[i])) for i in kept], axis=1) if kept else None
  where = _where(point.scope)
  period = coll.period(n)
  wrong = 0
  for shard in acc.addressable_shards:
    position = shard.index[0].start or 0
    gi, rank = where[position]
    group = point.scope.groups[gi]

    def known(buffer: tuple[str, int] | None, group=group) -> int:
      kind, q = buffer
      return int(table[group[q], BUFFERS.index(kind)])

    if chain is not None:  # the check program's own chain, repetition by repetition
      want_acc = expected_acc([int(d) for d in chain[offset:offset + count, position]], count)
    else:
      want_acc = expected_acc([known(coll.rep_output(rank, offset + k, n, platform)) for k in range(1, period + 1)],
                              count)
    want_final = [known(b) for b in coll.final_carry(rank, reps, n, platform) if b is not None]
    got_final = [int(v) for v in final[position]] if final is not None else []
    wrong += int(np.asarray(shard.data)[0]) != want_acc or got_final != want_final
  if chain is not None:
    return wrong, (f"every one of the {count} checked repetitions (the untimed twins of both arms) compared with the"
                   f" check program run on its own outputs: no known buffer holds a chained {coll.redop or ''}"
                   f" {coll.hlo_op}'s output; the plain programs replayed from the known inputs beside their twins")
  if count == reps:
    return wrong, f"every one of the {reps} repetitions compared (output digests)"
  return wrong, (f"every output of the {count} checked repetitions (the untimed twins of both arms, at least one"
                 f" period of the chain) and the final output of the timed calls after all {reps} compared (digests)")


def chain_digests(point: Point, reps: int) -> np.ndarray:
  """[reps, devices] uint32: every rank's digest of the output of each of `reps` operations chained from the known
  inputs, computed by the check program (verified element by element on those inputs, compiled apart from the
  timed programs), each call's output the next one's input: what a chained collective's repetitions must give
  where no known buffer holds them. A repetition's output is bit for bit the check program's on the same
  input: the same collective on the same data (the replay of the plain programs relies on the same)."""
  x, out = known_input_array(point), []
  for _ in range(reps):
    x = run_check_program(point, x)
    out.append(np.asarray(_digest_all(point.mesh)(x)))
  return np.stack(out) if out else np.zeros((0, point.mesh.size), np.uint32)


def replay_check(point: Point, short: Compiled, long: Compiled,
                 fresh: Callable[[], tuple[jax.Array, ...]] | None = None, acc_at: int = -1) -> tuple[int, str]:
  """For a collective whose chained outputs no known buffer holds (Collective.compared_to_op): each timed
  program and its twin run once more, untimed, from the known inputs; the plain program's final output must
  equal the twin's, whose every repetition must equal the check program's own chain (its accumulator must
  say so: chain_digests). A repetition the plain program gets wrong changes every later one (the chain
  carries it), so its final output differs. `fresh` makes a start carry (default: initial_carry), whose
  accumulator sits at `acc_at` (overlap's arms carry a matmul's operands after it). Returns this process's
  ranks that differ and a note."""
  fresh = fresh or (lambda: initial_carry(point))
  wrong = np.zeros(point.mesh.size, bool)
  local = [i for i, d in enumerate(point.mesh.devices.flat) if d.process_index == jax.process_index()]
  chain = chain_digests(point, max(short.reps, long.reps))
  for prog in (short, long):
    twin = _run(prog.checked, fresh())
    plain = _run(prog, fresh())
    acc = acc_at % len(twin)
    for i, (a, b) in enumerate(zip(twin, plain)):
      if i != acc and a.ndim == 1:
        wrong |= np.asarray(_digest_all(point.mesh)(a)) != np.asarray(_digest_all(point.mesh)(b))
    for shard in twin[acc].addressable_shards:
      p = shard.index[0].start or 0
      wrong[p] |= int(np.asarray(shard.data)[0]) != expected_acc([int(d) for d in chain[:prog.reps, p]], prog.reps)
  return int(wrong[local].sum()), ("the short and long programs replayed from the known inputs: final outputs equal"
                                   " to their checked twins'")


def call_time(point: Point) -> float:
  """Wall time of one call of the check program (one operation plus everything a call pays once)."""
  x = point.inputs()
  t0 = time.perf_counter()
  run_check_program(point, x)
  return time.perf_counter() - t0


def long_reps(call_s: float, max_reps: int, sample_s: float) -> int:
  """Operations in the long arm: as many as fit in `sample_s` at `call_s` per operation (an overestimate of
  one operation), even, within [MIN_LONG_REPS, max_reps]; `sample_s <= 0` gives max_reps."""
  cap = max(MIN_LONG_REPS, max_reps - max_reps % 2)
  if sample_s <= 0:
    return cap
  want = int(sample_s / max(call_s, 1e-9))
  return int(min(cap, max(MIN_LONG_REPS, want - want % 2)))


def _run(prog: Compiled, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  out = prog.fn(*carry)
  jax.block_until_ready(out)
  return out


MIN_SAMPLES = 5  # pairs a point always takes; past them it stops once `resolved` says so (see time_pairs)


def untimed_calls(warmup: int, short_reps: int, long_reps: int, period: int = 1) -> list[str]:
  """The checked twins' calls before the samples, in order ("long", "short"): the long arm's max(1, warmup)
  times, the short arm's once, then the long arm's until the digested repetitions span `period` (the chain's:
  every state a repetition can start from is digested once). They run whatever --warmup says, so the final
  carry is always a timed program's."""
  calls = ["long"] * max(1, warmup) + ["short"]
  done = max(1, warmup) * long_reps + short_reps
  while done < period:
    calls.append("long")
    done += long_reps
  return calls


def time_pairs(short: Compiled, long: Compiled, carry: tuple[jax.Array, ...], warmup: int, samples: int,
               barrier: Callable[[], None], inject_delay_s: float = 0.0,
               resolved: Callable[[np.ndarray, np.ndarray], bool] | None = None, graph_warmup: int = 0,
               period: int = 1) -> tuple[np.ndarray, np.ndarray, tuple[jax.Array, ...]]:
  """Seconds per call of each arm, up to `samples` of each, alternating (the order flips every pair so
  neither arm always runs first), and the final carry. The carry flows from call to call, donated each time:
  first `graph_warmup` untimed pairs of the timed programs themselves (XLA:GPU builds a command buffer's graph
  on its second call), then the checked twins, untimed (`untimed_calls`: both arms, every repetition's output
  digested, at least one `period` of the chain; they are the warm-up), then the timed pairs, so the final carry
  is the timed programs' own (`chain_reps` counts it all; check_timed compares it). From MIN_SAMPLES pairs on,
  after each pair, `resolved(t_short, t_long)` may end the point early: a point whose median is already
  resolved gains little from more pairs (a multi-process job must answer the same on every process: the
  sweep's answer is gathered). `inject_delay_s` (fault injection) is added per operation, so it survives the
  difference."""
  for _ in range(graph_warmup):
    carry = _run(long, _run(short, carry))
  arms = {"short": short, "long": long}
  for name in untimed_calls(warmup, short.reps, long.reps, period):
    carry = _run(arms[name].checked or arms[name], carry)
  t_short, t_long = [], []
  for i in range(samples):
    for prog in ((short, long) if i % 2 == 0 else (long, short)):
      barrier()
      t0 = time.perf_counter()
      carry = _run(prog, carry)
      if inject_delay_s:
        time.sleep(inject_delay_s * prog.reps)
      (t_short if prog is short else t_long).append(time.perf_counter() - t0)
    if resolved is not None and MIN_SAMPLES <= i + 1 < samples and resolved(np.asarray(t_short), np.asarray(t_long)):
      break
  return np.asarray(t_short), np.asarray(t_long), carry


def chain_reps(warmup: int, pairs: int, short_reps: int, long_reps: int, graph_warmup: int = 0,
               period: int = 1) -> tuple[int, tuple[int, int]]:
  """(repetitions in the final carry, (first digested repetition's offset, digested repetitions)) after
  time_pairs ran `graph_warmup` untimed pairs, the twins' untimed calls and `pairs` timed pairs."""
  pair = short_reps + long_reps
  ahead = graph_warmup * pair
  digested = sum(short_reps if c == "short" else long_reps
                 for c in untimed_calls(warmup, short_reps, long_reps, period))
  return ahead + digested + pairs * pair, (ahead, digested)


def time_calls(point: Point, warmup: int, samples: int, barrier: Callable[[], None],
               inject_delay_s: float = 0.0) -> tuple[np.ndarray, int | None]:
  """Latency mode: seconds of each of `samples` single-operation calls (dispatch included), and this process's
  count of timed calls x ranks whose output differed from the check output (None without a check): each
  output is digested after its call, outside the timed region. In place, every call runs on fresh known
  inputs (made before the barrier): a chained in-place sum has no known output."""
  chain = point.collective.inplace
  x = point.inputs()
  for _ in range(warmup):
    run_check_program(point, x)
    x = point.inputs() if chain else x
  want = None if point.digests is None else point.digests[:, BUFFERS.index("out")].astype(np.uint32)
  local = [i for i, d in enumerate(point.mesh.devices.flat) if d.process_index == jax.process_index()]
  times, wrong = [], 0
  for _ in range(samples):
    barrier()
    t0 = time.perf_counter()
    y = run_check_program(point, x)
    if inject_delay_s:
      time.sleep(inject_delay_s)
    times.append(time.perf_counter() - t0)
    if want is not None:
      wrong += int((np.asarray(_digest_all(point.mesh)(y)) != want)[local].sum())
    x = point.inputs() if chain else x
  return np.asarray(times), wrong if want is not None else None


def make_barrier(mesh: jax.sharding.Mesh) -> Callable[[], None]:
  """A cross-process barrier (a tiny all-reduce over every device); a no-op in a single process."""
  if jax.process_count() == 1:
    return lambda: None
  fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, mesh.axis_names), mesh=mesh, in_specs=jax.P(mesh.axis_names),
                             out_specs=jax.P(), check_vma=False))
  ones = _global_array(mesh, 1, lambda p: np.ones(1), jnp.int32)

  def barrier():
    fn(ones).block_until_ready()
  return barrier
