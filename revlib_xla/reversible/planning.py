"""What a reversible sequence prepares for each call (:class:`PlannedSequence`, the base of
:class:`revlib_xla.ReversibleSequential`): its input split into two streams, its settings read into one call's
:class:`~revlib_xla.reversible.plan.Plan` (parameters, arguments, dtypes, the exact streams' format), parameter
offload, the fused optimizer, FSDP2 units, and the checks it arms (``verify_inverse``, the stream range check)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

import torch
from torch import nn

from .. import _tree, backends, fsdp
from ..errors import ReversibleError
from ..fused_optimizer import FusedOptimizer, FusedOptimizerError
from ..offload import ParameterStreamer, offload_tensor
from ..recompute import CallReplay, RecomputeState, owned_buffers
from . import fixed_point as _fixed
from . import invertibility, rebuild_check
from .coupling import (
    is_additive_forward,
    is_additive_inverse,
)
from .layers import (
    FUSED_OPTIMIZER,
    LAYERWISE_ARGS_KWARGS,
    MemoryModes,
    ReversibleModule,
    describe_coupling,
    dtype_mismatch,
)
from .plan import LayerOffload, Plan, Slot, layer_label
from .stacks import stacked_views

Tensor = torch.Tensor


class PlannedSequence(nn.Sequential):
    """The per-call preparation of :class:`revlib_xla.ReversibleSequential` (its base; the settings below are set by
    its ``__init__``): the input split into streams, one call's :class:`Plan`, parameter offload, the fused
    optimizer, FSDP2 units, and the checks the call arms."""

    split_dim: int | None
    memory_mode: MemoryModes
    stream_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None
    preserve_rng_state: bool
    verify_inverse: bool | Literal["rebuild"] | None
    scan: bool | None
    exact: bool | None
    target_device: torch.device | None
    fused_optimizer_factory: FUSED_OPTIMIZER
    _verified: set
    _rebuild_pending: list[rebuild_check.Verdict]
    _own_fused: FusedOptimizer | None
    _attached_fused_optimizer: FusedOptimizer | None
    _streamer: tuple[tuple[int, ...], ParameterStreamer] | None

    # -- streams --------------------------------------------------------------------------------------------------
    def _split(self, inp) -> tuple[Tensor, Tensor, bool]:
        if isinstance(inp, (tuple, list)):
            if len(inp) != 2 or not all(isinstance(t, torch.Tensor) for t in inp):
                raise ReversibleError(
                    f"ReversibleSequential: a tuple input must be two stream tensors (x0, x1), got "
                    f"{[type(t).__name__ for t in inp]}"
                )
            x0, x1 = inp
            if x0.shape != x1.shape or x0.dtype != x1.dtype:
                raise ReversibleError(
                    f"ReversibleSequential: the two input streams must match in shape and dtype, got "
                    f"{tuple(x0.shape)} {x0.dtype} and {tuple(x1.shape)} {x1.dtype}"
                )
            return x0, x1, True
        if not isinstance(inp, torch.Tensor):
            raise ReversibleError(
                f"ReversibleSequential expects a tensor (or a (x0, x1) tuple of streams), got {type(inp).__name__}"
            )
        if self.split_dim is None:
            return inp, inp, False
        dim = self.split_dim
        if not -inp.dim() <= dim < inp.dim():
            raise ReversibleError(
                f"ReversibleSequential: split_dim={dim} is out of range for an input of shape {tuple(inp.shape)}"
            )
        if inp.shape[dim] % 2:
            raise ReversibleError(
                f"ReversibleSequential: the input has size {inp.shape[dim]} along split_dim={dim} (shape "
                f"{tuple(inp.shape)}), which cannot be split into two equal streams; make it even (e.g. double the "
                f"features before the reversible part)"
            )
        x0, x1 = inp.chunk(2, dim)
        return x0, x1, False

    def _merge(self, y0: Tensor, y1: Tensor, two_stream: bool):
        if two_stream:
            return y0, y1
        if self.split_dim is None:
            return (y0 + y1) / 2
        return torch.cat([y0, y1], self.split_dim)

    # -- arguments ------------------------------------------------------------------------------------------------
    def _plan(
        self, x0: Tensor, args, kwargs, layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS
    ) -> tuple[Plan, list[Tensor]]:
        """Deduplicated parameters and tensor arguments of every layer, and the stream and compute dtypes."""
        layers = cast(list[ReversibleModule], list(self._modules.values()))  # __init__ wraps every module
        names = list(self._modules.keys())
        if not (x0.dtype.is_floating_point or x0.dtype.is_complex):
            dtypes = sorted({str(p.dtype) for p in layers[0].parameters() if p.is_floating_point()}) or ["float"]
            raise ReversibleError(
                f"ReversibleSequential: the input is {x0.dtype}, but the reversible streams are floating point: "
                f"{layer_label(0, names[0], layers[0])} computes in {' and '.join(dtypes)} and its output is added "
                f"to them. Embed or cast the input first (nn.Embedding, or x.to({dtypes[0]}))."
            )
        if layerwise_args_kwargs is not None:
            if len(layerwise_args_kwargs) != len(layers):
                raise ReversibleError(
                    f"ReversibleSequential: layerwise_args_kwargs has {len(layerwise_args_kwargs)} entries but the "
                    f"model has {len(layers)} layers; give one (args, kwargs) pair per layer"
                )
        arg_tensors: list[Tensor] = []
        seen: dict[int, int] = {}

        def slot(t: Tensor) -> Slot:
            if id(t) not in seen:
                seen[id(t)] = len(arg_tensors)
                arg_tensors.append(t)
            return Slot(seen[id(t)])

        shared_args = _tree.map_tensors(slot, tuple(args))
        shared_kwargs = _tree.map_tensors(slot, dict(kwargs))
        layer_args = []
        for i in range(len(layers)):
            if layerwise_args_kwargs is None:
                layer_args.append((shared_args, shared_kwargs))
                continue
            entry = layerwise_args_kwargs[i]
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], dict)):
                raise ReversibleError(
                    f"ReversibleSequential: layerwise_args_kwargs[{i}] must be an (args, kwargs) "
                    f"pair with kwargs a dict, got {entry!r}"
                )
            own_args = _tree.map_tensors(slot, tuple(entry[0]))
            own_kwargs = _tree.map_tensors(slot, dict(entry[1]))
            layer_args.append((shared_args + own_args, {**shared_kwargs, **own_kwargs}))

        params: list[nn.Parameter] = []
        index: dict[int, int] = {}
        layer_params, layer_buffers, param_slots = [], [], []
        blocks_see = self.compute_dtype or x0.dtype
        check_dtypes = not backends.AutocastState.capture(x0.device).differs_from_now()  # autocast casts for them
        stacked = {p.dtype for p in self._parameters.values() if p is not None and p.is_floating_point()}  # scan
        for i, layer in enumerate(layers):
            own, slots, float_dtypes, modules = [], [], set(stacked), list(layer.modules())
            for module in modules:
                for name, p in module._parameters.items():
                    if p is not None and p.is_floating_point():
                        float_dtypes.add(p.dtype)
                    if p is None or not p.requires_grad:
                        continue
                    if id(p) not in index:
                        index[id(p)] = len(params)
                        params.append(p)
                    if index[id(p)] not in own:
                        own.append(index[id(p)])
                    slots.append((module, name, own.index(index[id(p)])))
            layer_params.append(own)
            layer_buffers.append(owned_buffers(modules))
            param_slots.append(slots)
            if check_dtypes and float_dtypes and blocks_see not in float_dtypes:
                raise dtype_mismatch(
                    layer_label(i, names[i], layer), float_dtypes, blocks_see, self.compute_dtype is not None
                )
        stream_dtype = self.stream_dtype if self.stream_dtype not in (None, x0.dtype) else None
        compute_dtype = blocks_see if blocks_see != (stream_dtype or x0.dtype) else None
        fixed = self._fixed_format(x0.dtype, layers, names)
        value_dtype = None
        if fixed is not None:  # the streams are integers; their values are decoded to at least float32
            value_dtype = torch.promote_types(x0.dtype, torch.float32)
            compute_dtype = blocks_see if blocks_see != value_dtype else None
        plan = Plan(
            layers,
            names,
            layer_args,
            [sorted({x.index for x in _tree.tree_leaves(a) if isinstance(x, Slot)}) for a in layer_args],
            params,
            layer_params,
            layer_buffers,
            CallReplay(x0.device, self.preserve_rng_state),
            stream_dtype,
            compute_dtype,
            RecomputeState.of(self),
            param_slots=param_slots,
            fixed=fixed,
            value_dtype=value_dtype,
        )
        plan.stacked = stacked_views(self)
        if self.target_device is not None:
            plan.offload = self._layer_offload(plan)
        # The fused optimizer built from fused_optimizer= is stepped by the backward walk, one layer at a time;
        # one attached by fuse_optimizer steps each parameter from its post-accumulate-grad hook, which the engine
        # runs as soon as the layer's backward has returned the gradient, as for any module.
        fused = self.fused_optimizer
        if fused is not None and self.memory_mode != MemoryModes.no_savings:
            fused.record_forward(x0.device)
            if fused is not self._attached_fused_optimizer:
                plan.fused, plan.fused_done = fused, self._fused_schedule(plan, fused)
        return plan, arg_tensors

    def _fixed_format(
        self, dtype: torch.dtype, layers: list[ReversibleModule], names: list[str]
    ) -> _fixed.FixedPoint | None:
        """The exact streams' format for an input of ``dtype``, or ``None`` for floating-point streams (``exact``)."""
        exact = self.__dict__.get("exact")  # models pickled before the argument existed: None
        if exact is False:
            return None
        additive = [
            is_additive_forward(layer.wrapped_module.coupling_forward)
            and is_additive_inverse(layer.wrapped_module.coupling_inverse)
            for layer in layers
        ]
        if exact is None:
            wide = dtype.is_complex or dtype.itemsize > 4  # float64 streams invert to ~1e-16 without a grid
            return None if wide or self.stream_dtype is not None or not all(additive) else _fixed.GRID
        if dtype.is_complex:
            raise ReversibleError(
                f"ReversibleSequential(exact=True): the input is {dtype}; exact streams hold real values. Pass "
                f"exact=False for complex streams."
            )
        if not all(additive):
            i = additive.index(False)
            raise ReversibleError(
                f"ReversibleSequential(exact=True): {layer_label(i, names[i], layers[i])} has a coupling that is not "
                f"additive ({describe_coupling(layers[i].wrapped_module.coupling_forward)}); exact (fixed-point) "
                f"streams invert additive couplings only. Pass exact=None (exact where possible, else the backward's "
                f"rebuild check) or exact=False."
            )
        return _fixed.GRID

    # -- parameter offload and fused optimizer --------------------------------------------------------------------
    def _layer_offload(self, plan: Plan) -> LayerOffload:
        """Each layer's block tensors (parameters, buffers) as one streamed unit; the streamer (and on cuda its
        two persistent device buffers) is reused across calls while the tensors stay the same objects."""
        index = {id(p): k for k, p in enumerate(plan.params)}
        units, names, param_pos, buffer_pos = [], [], [], []
        for layer in plan.layers:
            unit: list[Tensor] = []
            unit_names: list[list[str]] = []
            pos: dict[int, int] = {}
            own_params, own_buffers = {}, []
            block = layer.block
            for kind, items in (
                ("param", block.named_parameters(remove_duplicate=False)),
                ("buffer", block.named_buffers(remove_duplicate=False)),
            ):
                for name, t in items:
                    if id(t) not in pos:
                        pos[id(t)] = len(unit)
                        unit.append(t)
                        unit_names.append([])
                        if kind == "buffer":
                            own_buffers.append(pos[id(t)])
                        elif id(t) in index:
                            own_params[index[id(t)]] = pos[id(t)]
                    unit_names[pos[id(t)]].append(name)
            units.append(unit)
            names.append(unit_names)
            param_pos.append(own_params)
            buffer_pos.append(own_buffers)
        key = tuple(id(t) for unit in units for t in unit)
        if self._streamer is None or self._streamer[0] != key:
            self._streamer = (key, ParameterStreamer(units, self.target_device))
        for i in range(len(plan.layers)):
            missing = [k for k in plan.layer_params[i] if k not in param_pos[i]]
            if missing:
                raise ReversibleError(
                    f"{plan.describe(i)}: target_device streams the block's own parameters, but this layer also "
                    f"uses a parameter outside its block (in its coupling); move it into the block"
                )
        return LayerOffload(self._streamer[1], names, param_pos, buffer_pos)

    @property
    def streamer(self) -> ParameterStreamer | None:
        """With ``target_device``: the :class:`ParameterStreamer` of the last call (its ``max_resident`` and
        ``transfers`` say how many layers were on the device at once and how many were copied), else ``None``."""
        return None if self._streamer is None else self._streamer[1]

    def attach_fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Step ``optimizer``, fused into a model containing this sequence by :func:`revlib_xla.fuse_optimizer`
        (part of :class:`revlib_xla.fused_optimizer.StepsInBackward`)."""
        self._attached_fused_optimizer = optimizer

    def detach_fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Forget ``optimizer`` if it is the attached one (its fusion was removed)."""
        if self._attached_fused_optimizer is optimizer:
            self._attached_fused_optimizer = None

    @property
    def fused_optimizer(self) -> FusedOptimizer | None:
        """The optimizer stepped inside the backward pass (built from ``fused_optimizer=`` at the first forward,
        or attached by :func:`revlib_xla.fuse_optimizer`), or ``None``."""
        if self._attached_fused_optimizer is not None:
            return self._attached_fused_optimizer
        if self.fused_optimizer_factory is None:
            return None
        layers = list(self._modules.items())
        groups, names = [], []
        for name, layer in layers:
            trainable = [p for p in layer.parameters() if p.requires_grad]
            if trainable:
                groups.append(trainable)
                names.append(f"layer '{name}'")
        own = self._own_fused  # a copy of the model (deepcopy, pickle) holds a copy bound to its own parameters
        if own is None:
            self._own_fused = FusedOptimizer(groups, self.fused_optimizer_factory, names)
        elif [id(p) for p in own.params] != [id(p) for g in groups for p in g]:
            try:  # new tensors, e.g. from .to(device) across tensor types: state and learning rates follow them
                own.rebind(groups)
            except FusedOptimizerError:
                if any(opt.state for opt in own.optimizers):
                    raise
                self._own_fused = FusedOptimizer(groups, self.fused_optimizer_factory, names)  # layers changed
        return self._own_fused

    def _fused_schedule(self, plan: Plan, fused: FusedOptimizer) -> list[list[int]]:
        users: dict[int, list[int]] = {}
        for i, own in enumerate(plan.layer_params):
            for k in own:
                users.setdefault(k, []).append(i)
        for k, layers in users.items():
            if len(layers) > 1 and fused.covers(plan.params[k]):
                raise FusedOptimizerError(
                    f"ReversibleSequential: a fused optimizer cannot step a parameter shared by layers "
                    f"{', '.join(plan.describe(i) for i in layers)}: its gradient arrives in parts, one per layer, "
                    f"and the first layers' recomputation still reads it. Untie the weights or use an unfused "
                    f"optimizer"
                )
        return [[j for j, k in enumerate(own) if fused.covers(plan.params[k])] for own in plan.layer_params]

    def _judge(self, plan: Plan, guard: _fixed.StreamGuard, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        """The forward's stream range check: read now and raised (an eager device outside data parallelism), or,
        where a read would cost the step (a lazy device) or leave the other processes of the group that decides
        together waiting (:func:`revlib_xla._rebuild_check.agreeing_group`), the outputs made NaN if it failed (no
        read; the guard is kept for :func:`stream_range_error`). A value that is not finite (a block's float16
        overflow under autocast, say) makes the outputs NaN on every device, as it makes the plain model's loss NaN:
        a gradient scaler then skips the step; :func:`stream_range_error` names the layer."""
        guard.close()
        poison = guard.poison()
        if poison is None:
            return x0, x1
        if not (backends.is_tracing_lazily(x0) or rebuild_check.agreeing_group(plan.params) is not None):
            if guard.finite():
                guard.judge()
                return x0, x1
        self.__dict__["_last_guard"] = guard
        return x0 + poison.to(x0.dtype), x1 + poison.to(x1.dtype)

    def _fsdp_units(self, plan: Plan) -> list[fsdp.LayerUnits | None] | None:
        """The FSDP2 units inside the blocks, per layer (see :mod:`revlib_xla.fsdp`), refusing the layouts the
        reversible backward cannot run exactly."""
        try:
            units = fsdp.layer_units(
                plan.layers, [w.wrapped_module for w in plan.wrappers], plan.names, plan.param_slots
            )
        except fsdp.FSDPLayoutError as err:
            raise ReversibleError(str(err)) from None
        if units is not None and self.fused_optimizer_factory is not None:
            raise FusedOptimizerError(
                "ReversibleSequential: fused_optimizer steps each layer from the gradients its backward computes, but "
                "some blocks are FSDP2 units (fully_shard), whose gradients FSDP2 reduce-scatters across processes "
                "after the layer's backward: build the sequence without fused_optimizer and step an unfused optimizer."
            )
        if units is not None and plan.offload is not None:
            raise ReversibleError(
                "ReversibleSequential: target_device streams each block's parameters to the device, but some blocks "
                "are FSDP2 units (fully_shard), which hold their parameters sharded across processes: use one or the "
                "other (FSDP2's CPUOffloadPolicy offloads sharded parameters)."
            )
        return units

    def _verify(
        self, plan: Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor], inputs: tuple[Tensor, Tensor]
    ) -> None:
        """``verify_inverse`` at a forward whose backward rebuilds, once per pair of stream and compute dtypes:
        :func:`check_invertible` now, or (the default for additive couplings) the backward's own rebuild of the
        input measured against it (:mod:`revlib_xla._rebuild_check`), armed on the plan."""
        key = (x0.dtype, plan.compute_dtype)
        verify = self.verify_inverse
        if verify is False or key in self._verified or not backends.holds_data(x0):
            return  # fake tensors (sizing a model under FakeTensorMode) have no values to check
        if verify is True or (
            verify is None
            and not all(
                is_additive_forward(w.coupling_forward) and is_additive_inverse(w.coupling_inverse)
                for w in plan.wrappers
            )
        ):
            self._verified.add(key)
            invertibility.check_plan(plan, x0, x1, arg_tensors)
        # Also on a lazy device (XLA): the first step's graph gets one more output than the next steps', which
        # costs one more compilation where the first two steps' graphs are otherwise the same (SGD, or optimizer
        # state restored from a checkpoint); a silently wrong gradient costs more. verify_inverse=False skips it.
        elif rebuild_check.armed():
            autocast = plan.call.autocast  # the blocks compute in its dtype: the tolerance of the coarsest
            cast = [
                d for on, d in ((autocast.enabled, autocast.dtype), (autocast.cpu_enabled, autocast.cpu_dtype)) if on
            ]
            plan.rebuild = rebuild_check.RebuildCheck(
                key,
                max(rebuild_check.tolerance(x0.dtype, d) for d in [plan.compute_dtype, *cast]),
                len(plan.layers),
                self._verified,
                self.__dict__.setdefault("_rebuild_pending", []),  # models pickled before it existed: created here
                fused=self.fused_optimizer is not None,
                replays_random=plan.call.preserves,
                autocast=cast[0] if cast else None,
                group=rebuild_check.agreeing_group(plan.params),  # data parallel: the processes decide together
            )
            if plan.fixed is None:
                plan.rebuild.keep(0, x0, x1)
            else:  # the input itself (an alias, no memory); its streams are encoded when compared
                plan.rebuild.keep(0, *inputs, plan.fixed)

    def _plain_offload(self, plan: Plan, i: int) -> list[Tensor] | None:
        """``target_device`` under plain autograd (``no_savings``, or no gradients): each tensor is copied
        differentiably (:func:`offload_tensor`), so the graph keeps what it saves; memory is saved only by the
        reversible modes."""
        if plan.offload is None:
            return None
        return [offload_tensor(t, plan.offload.streamer.device) for t in plan.offload.streamer.units[i]]
