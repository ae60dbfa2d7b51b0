"""One process, several devices: a mesh from the run config, parameters sharded FSDP-style, the batch split.

On a TPU VM one process drives all its chips through torch_xla's SPMD partitioner: tensors are annotated with how
they are split over a mesh of devices, and the compiler partitions the step and inserts the collectives (this is
what torch_xla's FSDPv2 does; here the annotations are put on our own models directly, so the reversible and
planned steps, whose recomputation runs inside one ``autograd.Function``, compose with it unchanged).

The mesh has three named axes, in this order: ``data`` (replicas of the parameters), ``fsdp`` (the parameters and
their optimizer state split over it, ZeRO-3 style) and ``tensor`` (Megatron-style splits of each block's matrices).
The config's ``mesh`` section gives their sizes, one of them ``-1`` for the devices the others leave
(:func:`resolve_mesh`).

* Parameters (:func:`parameter_spec`): a Llama block's projections follow Megatron's rule on ``tensor`` (the
  output features of ``q/k/v/gate/up_proj``, the embedding and the head; the input features of ``o_proj`` and
  ``down_proj``) and are split over ``fsdp`` along their other dimension; any other matrix is split over
  ``fsdp`` along its largest dimension that divides evenly. Vectors (norm scales, biases) are whole on every device.
  Scanned layers' stacked parameters (:func:`revlib_xla.scan.stack_layers`) are split as their layers, the layer
  dimension whole.
* The token batch (:func:`shard_batch`): split along its first dimension over ``data x fsdp``.
* Initialisation (:class:`ShardedWriter`, what ``build_model`` does under a mesh): the model is built on the meta
  device, and each weight is drawn whole on the host, in the order and from the generator of the unsplit init (so
  the values are bit for bit the same), and sent as pieces, each device receiving only its own: no device ever holds
  the whole model, and the host one weight at a time. Stacked (scanned) layers' parameters are still drawn layer by
  layer into the whole stack and split after.

Memory per device of the parameters, gradients and optimizer state is then ``1/(fsdp*tensor)`` of the model's,
and of the activations ``1/(data*fsdp)``. The same rules size a pod slice without the pod: :func:`shard_step`
annotates a step traced for one chip (:func:`revlib_xla.fit.trace_step`) with these shardings, and the TPU compiler
partitions it for ``N`` chips of a topology (``revlib-xla memory --chips N``).

Device knowledge stays in the backends: :meth:`revlib_xla.backends.base.Backend.spmd_device_count` says how many
devices one process drives (1 on cpu and cuda, where a run over several devices is several processes: FSDP2 or DDP
under ``torchrun``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from . import backends
from .compiled.roles import INPUTS, OPTIMIZER, PARAMETERS

__all__ = [
    "AXES",
    "BATCH_AXES",
    "ShardingError",
    "MeshShape",
    "Mesh",
    "Spec",
    "resolve_mesh",
    "parameter_spec",
    "batch_spec",
    "check_batch",
    "hlo_sharding",
    "make_mesh",
    "apply_mesh",
    "active_mesh",
    "planning_budget",
    "shard_model",
    "host_pieces",
    "ShardedWriter",
    "shard_batch",
    "shard_step",
]

#: The mesh axes, in mesh order.
AXES = ("data", "fsdp", "tensor")
#: The axes the batch is split over.
BATCH_AXES = ("data", "fsdp")

#: Modules (by attribute name) whose weight ``(out, in)`` is split over ``tensor`` along its output features.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed", "head")
#: Modules whose weight is split over ``tensor`` along its input features.
ROW_PARALLEL = ("o_proj", "down_proj")

#: The prefix of a stacked parameter's attribute (:func:`revlib_xla.scan.stack_layers`).
STACKED = "stacked_"

#: How a tensor is split: per dimension, the mesh axis (or axes) it is split over, or ``None`` (whole).
Spec = tuple[str | tuple[str, ...] | None, ...]


class ShardingError(ValueError):
    """A mesh or a sharding that cannot work: the message names the axis, the sizes and what to do."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The size of each mesh axis (all resolved: no ``-1``)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes in mesh order (:data:`AXES`)."""
        return (self.data, self.fsdp, self.tensor)

    @property
    def size(self) -> int:
        """The number of devices."""
        return math.prod(self.sizes)

    def ways(self, entry: str | tuple[str, ...] | None) -> int:
        """Into how many pieces a dimension split over ``entry`` (one axis, several, or ``None``) is cut."""
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        return math.prod(getattr(self, a) for a in axes)

    def __str__(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in zip(AXES, self.sizes))


def resolve_mesh(axes: Mapping[str, int], devices: int, *, backend_name: str = "") -> MeshShape:
    """The mesh of ``axes`` (``{"fsdp": -1, "tensor": 1, "data": 1}``; missing axes are 1, ``-1`` = the devices the
    others leave) over ``devices`` devices. Raises :class:`ShardingError` for an unknown axis, a size that is not
    a positive number of devices, more than one ``-1``, or axes that do not multiply to ``devices``;
    ``backend_name`` is named in that message."""
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ShardingError(f"mesh: unknown axis {', '.join(map(repr, unknown))}; the axes are {', '.join(AXES)}")
    sizes = {a: int(axes.get(a, 1)) for a in AXES}
    bad = [f"{a}={n}" for a, n in sizes.items() if n != -1 and n < 1]
    if bad:
        raise ShardingError(f"mesh: {', '.join(bad)}: an axis is a number of devices (>= 1), or -1 for the rest")
    filled = [a for a, n in sizes.items() if n == -1]
    if len(filled) > 1:
        raise ShardingError(f"mesh: only one axis may be -1 (the devices the others leave), not {' and '.join(filled)}")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    where = f"the {backend_name} backend" if backend_name else "the run"
    if filled:
        if devices % fixed:
            raise ShardingError(
                f"mesh: {_written(sizes)}: the fixed axes multiply to {fixed}, which does not divide the {devices} "
                f"device(s) of {where}; choose sizes whose product divides {devices}"
            )
        sizes[filled[0]] = devices // fixed
    elif fixed != devices:
        raise ShardingError(
            f"mesh: {_written(sizes)} multiplies to {fixed} devices but {where} drives {devices}"
            + _no_spmd_hint(devices, fixed)
        )
    return MeshShape(**sizes)


def _written(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"mesh.{a}={n}" for a, n in sizes.items())


def _no_spmd_hint(devices: int, wanted: int) -> str:
    if devices != 1 or wanted == 1:
        return f"; make the axes multiply to {devices} (or set one axis to -1)"
    return (
        ": one process drives one device there (no SPMD partitioner), so every mesh axis must be 1 (or -1); to "
        "train over several GPUs run several processes with FSDP2 or DDP under torchrun (README: 'Several "
        "processes: DDP and FSDP2')"
    )


def _divides(ways: int, size: int) -> bool:
    return ways == 1 or size % ways == 0


def parameter_spec(name: str, shape: Sequence[int], mesh: MeshShape) -> Spec:
    """How the parameter ``name`` (its qualified name, e.g. ``layers.0.attn.self_attn.q_proj.weight``) of
    ``shape`` is split over ``mesh`` (see the module docstring). An axis is used only where it divides the
    dimension evenly; a parameter nothing divides stays whole on every device.

    A stacked parameter (:func:`revlib_xla.scan.stack_layers`: ``<sequence>.stacked_<layer>_<path with dots as
    underscores>``, one ``[layers, ...]`` tensor for a repeated layer's parameter) gets its layers' rule on the
    dimensions after the first and keeps the layer dimension whole: split over it, each scan iteration would
    gather its layer from other devices, and the Megatron split of each layer's matrices would be lost."""
    shape = tuple(int(d) for d in shape)
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith(STACKED) and len(shape) > 1:
        return (None, *parameter_spec(_layer_name(leaf), shape[1:], mesh))
    spec: list[str | None] = [None] * len(shape)
    if len(shape) < 2:
        return tuple(spec)
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 else ""
    if len(shape) == 2 and owner in COLUMN_PARALLEL + ROW_PARALLEL:
        tensor_dim = 0 if owner in COLUMN_PARALLEL else 1
        if _divides(mesh.tensor, shape[tensor_dim]) and mesh.tensor > 1:
            spec[tensor_dim] = "tensor"
        order = [1 - tensor_dim, tensor_dim]
    else:
        order = sorted(range(len(shape)), key=lambda d: -shape[d])
    if mesh.fsdp > 1:
        for dim in order:
            if spec[dim] is None and _divides(mesh.fsdp, shape[dim]):
                spec[dim] = "fsdp"
                break
    return tuple(spec)


def _layer_name(stacked: str) -> str:
    """A layer's name for its parameter stacked as ``stacked`` (the stack's attribute): ``<owner>.<leaf>`` where
    the owner is one of the Megatron modules (the stacked name joins the path with underscores), else the
    attribute without the prefix (the generic rule does not read the name)."""
    for owner in COLUMN_PARALLEL + ROW_PARALLEL:
        for leaf in ("weight", "bias"):
            if stacked.endswith(f"_{owner}_{leaf}"):
                return f"{owner}.{leaf}"
    return stacked.removeprefix(STACKED)


def batch_spec(ndim: int) -> Spec:
    """The batch's split: its first dimension over ``data x fsdp``, the others whole."""
    return (BATCH_AXES, *([None] * (ndim - 1)))


def check_batch(batch: int, mesh: MeshShape, what: str = "the batch") -> None:
    """Raise :class:`ShardingError` unless ``batch`` rows split evenly over ``data x fsdp``."""
    ways = mesh.ways(BATCH_AXES)
    if batch % ways:
        raise ShardingError(
            f"{what} of {batch} rows does not split over the mesh's data x fsdp = {mesh.data} x {mesh.fsdp} = "
            f"{ways} devices; use a batch that is a multiple of {ways}"
        )


def hlo_sharding(spec: Spec, mesh: MeshShape) -> str:
    """``spec`` over ``mesh`` as an XLA HLO sharding (``{devices=[...]...}``), with the devices numbered as the
    mesh's ``np.arange(size).reshape(data, fsdp, tensor)``, as :func:`make_mesh` lays them out; the axes a spec
    does not use replicate the pieces (``last_tile_dim_replicate``)."""
    used: list[str] = []
    tiles = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        used.extend(axes)
        tiles.append(mesh.ways(axes))
    if math.prod(tiles) == 1:
        return "{replicated}"
    rest = [a for a in AXES if a not in used]
    ids = np.arange(mesh.size).reshape(mesh.sizes).transpose([AXES.index(a) for a in used + rest])
    replicas = mesh.ways(tuple(rest))
    dims = tiles + ([replicas] if replicas > 1 else [])
    devices = ",".join(str(int(i)) for i in ids.reshape(-1))
    return f"{{devices=[{','.join(map(str, dims))}]{devices}{' last_tile_dim_replicate' if replicas > 1 else ''}}}"


# ----------------------------------------------------------------------------------------------------------------
# Training: the mesh of the devices this process drives


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The mesh a run trains on: its ``shape`` and the backend's mesh object (``handle``) over ``device``."""

    shape: MeshShape
    device: torch.device
    handle: Any


_ACTIVE: list[Mesh | None] = [None]


def make_mesh(axes: Mapping[str, int], device: backends.DeviceLike) -> Mesh | None:
    """The mesh of ``axes`` over every device the process drives through ``device``'s backend, with SPMD switched
    on; ``None`` where that is one device (nothing to shard). Call it before any tensor is put on the device."""
    dev = backends.as_device(device)
    family = backends.backend_for(dev)
    devices = family.spmd_device_count(dev)
    shape = resolve_mesh(axes, devices, backend_name=repr(dev.type))
    if shape.size == 1:
        return None
    return Mesh(shape, dev, family.spmd_mesh(shape.sizes, AXES))


def apply_mesh(cfg: Any, device: backends.DeviceLike = None) -> Mesh | None:
    """The mesh of run config ``cfg`` (its ``mesh`` section) over the devices this process drives, made the active
    one (:func:`shard_batch` splits each step's batch over it, :func:`revlib_xla.train.strategy.build_model` the
    parameters), after checking that the run can use it: the batch (per micro-batch) splits over ``data x fsdp``
    and the parameters are not streamed from host memory. ``None`` (and no active mesh) on one device. The planned
    strategy (``strategy.activations=plan``) plans for each device's share of the batch (:func:`planning_budget`).

    ``device``: where the run goes (default: ``train.device``, ``auto`` = the default device's family). Call it
    before anything is put on that device: SPMD is switched on before the runtime starts."""
    if device is None:
        kind = cfg.train.device if cfg.train.device != "auto" else backends.default_device_type()
        if not backends.device_available(kind):
            _ACTIVE[0] = None
            return None  # the run's device check names the problem
        device = torch.device(kind)
    mesh = make_mesh(cfg.mesh.axes(), device)
    _ACTIVE[0] = mesh
    if mesh is None:
        return None
    micro = cfg.data.batch_size // cfg.optim.grad_accum_steps
    what = "data.batch_size" + (" / optim.grad_accum_steps (a micro-batch)" if cfg.optim.grad_accum_steps > 1 else "")
    check_batch(micro, mesh.shape, what)
    if cfg.strategy.offload.params:
        raise ShardingError(
            f"strategy.offload.params=true streams whole layers from host memory to one device and cannot be split "
            f"over the mesh ({mesh.shape}); under a mesh the parameters are already split 1/{mesh.shape.fsdp} per "
            f"device: set strategy.offload.params=false, or every mesh axis to 1"
        )
    return mesh


def planning_budget(budget: int, mesh: Mesh | None) -> int:
    """The budget the planner (``strategy.activations=plan``) solves against, for ``budget`` bytes of activations
    per device. The planner measures the stages on the whole batch of the step, where each device of ``mesh``
    holds ``1/(data*fsdp)`` of it; every size it plans with (checkpoints, saved activations, temporaries) grows
    with the batch, so the whole batch's schedule within ``budget * data * fsdp`` bytes is each device's within
    ``budget``. (A ``tensor`` axis splits some activations further; the plan counts them whole: it errs towards
    memory.) Without a mesh: ``budget``."""
    return budget if mesh is None else budget * mesh.shape.ways(BATCH_AXES)


def active_mesh(device: backends.DeviceLike = None) -> Mesh | None:
    """The mesh :func:`apply_mesh` made active (``None``: one device), or with ``device``: that mesh if it is
    over ``device``'s family (a model built on the CPU beside a run over XLA devices is not split)."""
    mesh = _ACTIVE[0]
    if mesh is None or device is None:
        return mesh
    return mesh if backends.backend_for(device) is backends.backend_for(mesh.device) else None


def shard_model(model: nn.Module, mesh: Mesh, placed: Collection[int] = ()) -> dict[str, Spec]:
    """Split every parameter of ``model`` over ``mesh`` (:func:`parameter_spec`), in place, but those whose id is
    in ``placed`` (split already: :class:`ShardedWriter`); returns each parameter's spec by name. The optimizer
    state created from them follows their sharding."""
    family = backends.backend_for(mesh.device)
    specs = {}
    for name, param in model.named_parameters():
        spec = parameter_spec(name, param.shape, mesh.shape)
        if any(entry is not None for entry in spec) and id(param) not in placed:
            family.mark_sharding(param, mesh.handle, spec)
        specs[name] = spec
    return specs


def host_pieces(value: torch.Tensor, spec: Spec, mesh: MeshShape) -> list[torch.Tensor]:
    """The piece of ``value`` (a whole host tensor) each device of ``mesh`` holds when it is split as ``spec``
    says, in the mesh's device order (``np.arange(size).reshape(data, fsdp, tensor)``, as :func:`make_mesh` lays
    the devices out; a dimension split over several axes is cut in their order, the first the slowest). The
    parameter rules split only dimensions the axes divide (:func:`parameter_spec`); another split is refused."""
    pieces = []
    for device in range(mesh.size):
        coords = dict(zip(AXES, np.unravel_index(device, mesh.sizes)))
        index = []
        for dim, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            ways = mesh.ways(axes)
            if value.shape[dim] % ways:
                raise ShardingError(f"dimension {dim} of {tuple(value.shape)} does not split {ways} ways ({spec})")
            at = int(np.ravel_multi_index([int(coords[a]) for a in axes], [getattr(mesh, a) for a in axes]))
            size = value.shape[dim] // ways
            index.append(slice(at * size, (at + 1) * size))
        pieces.append(value[tuple(index)].contiguous())
    return pieces


class ShardedWriter:
    """For initialising ``model`` (materialised on ``mesh``'s device, e.g. by ``to_empty``) one parameter at a time
    from whole host values, each device receiving only its piece: ``write(param, value)`` makes ``param`` hold
    ``value`` (cast to ``dtype``, default the parameter's) split over ``mesh`` as :func:`parameter_spec` says for
    its name in ``model``. No device ever holds a whole parameter it does not keep, and the host holds one
    parameter (and its pieces) at a time. A tensor that is not one of ``model``'s parameters (a layer's view of a
    stacked parameter) is copied whole: :func:`shard_model` splits it after. ``placed``: the ids of the parameters
    written split (:func:`shard_model` leaves them: marking them again would send them through the host)."""

    def __init__(self, model: nn.Module, mesh: Mesh, dtype: torch.dtype | None = None) -> None:
        self.mesh = mesh
        self.dtype = dtype
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.placed: set[int] = set()

    def __call__(self, param: torch.Tensor, value: torch.Tensor) -> None:
        name = self.names.get(id(param))
        if name is None:
            param.copy_(value)
            return
        spec = parameter_spec(name, param.shape, self.mesh.shape)
        value = value.to(self.dtype or param.dtype)
        family = backends.backend_for(self.mesh.device)
        param.data = family.from_host_pieces(host_pieces(value, spec, self.mesh.shape), self.mesh.handle, spec)
        self.placed.add(id(param))


def shard_batch(tokens: torch.Tensor, mesh: Mesh | None = None) -> torch.Tensor:
    """``tokens`` (on the mesh's device) split along the batch over ``data x fsdp`` of ``mesh`` (default: the
    active mesh over ``tokens``' device; none: ``tokens`` unchanged). Raises :class:`ShardingError` for a batch
    that does not split."""
    mesh = mesh or active_mesh(tokens.device)
    if mesh is None:
        return tokens
    check_batch(tokens.shape[0], mesh.shape)
    backends.backend_for(mesh.device).mark_sharding(tokens, mesh.handle, batch_spec(tokens.ndim))
    return tokens


# ----------------------------------------------------------------------------------------------------------------
# Sizing: a traced one-chip step, partitioned for N chips by the compiler


def shard_step(traced: Any, mesh: MeshShape) -> Any:
    """The traced step ``traced`` (a :class:`revlib_xla.fit.TracedStep`, traced for one chip) annotated with the
    shardings a run over ``mesh`` gives its arguments: parameters by :func:`parameter_spec`, each optimizer-state
    tensor as its parameter (when of the same shape), the inputs along the batch, the rest whole. Compiled with
    ``mesh.size`` partitions, the TPU compiler's figures are per chip. One device: ``traced`` itself."""
    if mesh.size == 1:
        return traced
    params = {a.name: a for a in traced.arguments if a.role == PARAMETERS}
    specs: list[Spec] = []
    for argument in traced.arguments:
        spec: Spec = (None,) * len(argument.shape)
        if argument.role == PARAMETERS:
            spec = parameter_spec(argument.name, argument.shape, mesh)
        elif argument.role == OPTIMIZER:
            owner = params.get(argument.name.rsplit(".", 1)[0])
            if owner is not None and owner.shape == argument.shape:
                spec = parameter_spec(owner.name, owner.shape, mesh)
        elif argument.role == INPUTS and argument.shape:
            check_batch(argument.shape[0], mesh, f"the batch ({argument.name})")
            spec = batch_spec(len(argument.shape))
        specs.append(spec)
    return traced.partitioned(
        [hlo_sharding(s, mesh) for s in specs], [tuple(mesh.ways(e) for e in s) for s in specs], mesh.size
    )
