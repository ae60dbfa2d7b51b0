"""Trace a real training step at its real size without allocating it, as the program a TPU would compile.

A model built on the ``meta`` device has shapes and no memory. :func:`trace_step` gives every meta parameter,
buffer and input a device tensor over untouched host memory (``torch.empty``: the pages are never written, so a
16 GB model costs no RAM), through :func:`revlib_xla.backends.zero_copy_device_tensor` (on XLA: DLPack, no copy).
It then runs the user's own step function lazily, twice: the first call creates the optimizer's state, which is
then given fresh zero-copy storage like the parameters, so that the second call is the steady-state step whose
program a TPU runs on every step after the first. The traced step never executes
(:func:`revlib_xla.backends.tracing.execution_forbidden`): a step that reads a value raises instead of running. (The
first call may read small values, e.g. the recompute engine compares buffers with copies once; a step that reads the
loss runs it once at full size there, so keep value reads out of the step function.) A planner that measures its
stages in the first step (``Checkpointable``) sizes them from their compiled programs on stand-in inputs
(:func:`revlib_xla.backends.tracing.stand_in_inputs`).

The program is the StableHLO of what the step changes: its result (the loss), every parameter, buffer and
optimizer-state tensor. torch_xla donates the buffers of tensors updated in place (a parameter's new value
overwrites the old one, ``XLA_ENABLE_PARAM_ALIASING``), but the StableHLO text it hands out does not say so; the
traced step marks those aliases (``tf.aliasing_output`` on the argument), so the compiler counts a parameter, its
update and the optimizer state once, as on a TPU. :class:`TracedStep` records each argument's role (parameter,
optimizer state, buffer, input) and size, which the report uses to split the compiled peak exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .. import backends
from .._tree import tensor_leaves
from ..backends import tracing
from ..compiled.roles import BUFFERS, INPUTS, OPTIMIZER, OTHER, PARAMETERS, ROLES

__all__ = [
    "PARAMETERS",
    "OPTIMIZER",
    "BUFFERS",
    "INPUTS",
    "OTHER",
    "ROLES",
    "StepArgument",
    "TracedStep",
    "HostStepping",
    "trace_step",
    "mark_aliases",
    "stablehlo_arguments",
    "materialize",
    "device_data",
]


_ELEMENT_BYTES = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "i64": 8,
    "ui64": 8,
    "i32": 4,
    "ui32": 4,
    "i16": 2,
    "ui16": 2,
    "i8": 1,
    "ui8": 1,
    "i1": 1,
    "f8E4M3FN": 1,
    "f8E5M2": 1,
    "complex<f32>": 8,
    "complex<f64>": 16,
}
_MAIN = re.compile(r"func\.func (?:public )?@main\(")
_ARGUMENT = re.compile(r'%arg(\d+): tensor<([^>]*)>( \{(?:[^{}"]|"[^"]*")*\})?')


@dataclasses.dataclass(frozen=True)
class StepArgument:
    """One argument of a traced step's program: its position, ``role`` (one of :data:`ROLES`), ``name`` (the
    parameter's or buffer's qualified name, ``'<param>.<state key>'`` for optimizer state, ``'input <i>'``), its
    ``shape``, ``dtype`` (StableHLO element type) and ``nbytes``, and the program output it is donated to
    (``output``; ``None``: not aliased). In a step partitioned over several chips (:meth:`TracedStep.partitioned`),
    ``tiles`` says into how many pieces each dimension is cut, and :attr:`chip_nbytes` is what one chip holds."""

    index: int
    role: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    output: int | None
    tiles: tuple[int, ...] | None = None

    @property
    def chip_nbytes(self) -> int:
        """The bytes of the piece one chip holds (the largest, where a dimension does not divide evenly)."""
        if not self.tiles or not self.shape:
            return self.nbytes
        piece = math.prod(-(-size // ways) for size, ways in zip(self.shape, self.tiles))
        return piece * (self.nbytes // math.prod(self.shape)) if math.prod(self.shape) else 0


@runtime_checkable
class HostStepping(Protocol):
    """An optimizer that steps on the host (ZeRO-Offload style, :class:`revlib_xla.train.HostOptimizerState`):
    its ``step()`` runs the device program, brings the gradients to the host, updates host master weights and
    copies them back. The traced step is its device part only: within ``device_part_only()`` its step collects the
    gradients it would send (they become outputs of the program) and does nothing else; ``host_state_bytes()`` is
    the host memory its state and master weights take, reported beside the program's."""

    def device_part_only(self) -> contextlib.AbstractContextManager[list[torch.Tensor]]: ...

    def host_state_bytes(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A training step traced at full size: ``stablehlo`` (aliases marked; compile it with
    :func:`revlib_xla.memory.tpu_memory`), ``unaliased_stablehlo`` (the text torch_xla gave), its ``arguments``
    and ``outputs`` (names, in the program's order); ``host_bytes``: what the step's optimizer keeps in host
    memory outside the program (:class:`HostStepping`; 0 for others); ``partitions``: the number of chips the
    program is split over by the SPMD partitioner (:meth:`partitioned`); its sizes are then per chip."""

    stablehlo: str
    unaliased_stablehlo: str
    arguments: tuple[StepArgument, ...]
    outputs: tuple[str, ...]
    host_bytes: int = 0
    partitions: int = 1
    #: what the traced step decided that its figures do not say (the planner's schedule), for the report's notes
    notes: tuple[str, ...] = ()

    def argument_bytes(self, role: str | None = None) -> int:
        """Bytes one chip holds of the arguments with ``role`` (all of them when ``None``)."""
        if role is not None and role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
        return sum(a.chip_nbytes for a in self.arguments if role is None or a.role == role)

    def partitioned(self, shardings: Sequence[str], tiles: Sequence[tuple[int, ...]], partitions: int) -> TracedStep:
        """This step split over ``partitions`` chips by the compiler's SPMD partitioner: argument ``i`` annotated
        with the HLO sharding ``shardings[i]`` (cut ``tiles[i]`` ways per dimension), each output that reuses a
        donated argument's buffer sharded as that argument, the other outputs whole on every chip."""
        if len(shardings) != len(self.arguments) or len(tiles) != len(self.arguments):
            raise ValueError(f"one sharding per argument: {len(self.arguments)} arguments, {len(shardings)} given")
        results = {a.output: shardings[a.index] for a in self.arguments if a.output is not None}
        return dataclasses.replace(
            self,
            stablehlo=_annotate_shardings(self.stablehlo, list(shardings), results, partitions),
            arguments=tuple(dataclasses.replace(a, tiles=tuple(t)) for a, t in zip(self.arguments, tiles)),
            partitions=partitions,
        )

    @property
    def aliases(self) -> dict[int, int]:
        """Argument index -> the output index it is donated to."""
        return {a.index: a.output for a in self.arguments if a.output is not None}

    @property
    def aliased_bytes(self) -> int:
        """Bytes of the arguments whose buffers the step's outputs reuse."""
        return sum(a.nbytes for a in self.arguments if a.output is not None)


def stablehlo_arguments(stablehlo: str) -> list[tuple[tuple[int, ...], str, int]]:
    """``(shape, element type, bytes)`` of each argument of a StableHLO module's ``main`` function, in order."""
    head = _main_signature(stablehlo)[2]
    found: list[tuple[tuple[int, ...], str, int]] = []
    for match in _ARGUMENT.finditer(head):
        if int(match.group(1)) != len(found):
            raise ValueError(f"StableHLO main arguments out of order at %arg{match.group(1)}")
        *dims, dtype = match.group(2).split("x") if match.group(2) else [""]
        if dtype not in _ELEMENT_BYTES or any(not d.isdigit() for d in dims):
            raise ValueError(f"cannot size the StableHLO argument %arg{match.group(1)}: tensor<{match.group(2)}>")
        shape = tuple(int(d) for d in dims)
        found.append((shape, dtype, math.prod(shape) * _ELEMENT_BYTES[dtype]))
    return found


def _main_signature(stablehlo: str) -> tuple[int, int, str]:
    """(start, end, text) of the ``main`` function's argument list (from ``(`` to the ``) ->`` or ``) {``)."""
    match = _MAIN.search(stablehlo)
    if match is None:
        raise ValueError("the StableHLO module has no main function")
    depth, i = 1, match.end()
    while depth and i < len(stablehlo):
        depth += {"(": 1, ")": -1}.get(stablehlo[i], 0)
        i += 1
    return match.end(), i - 1, stablehlo[match.end() : i - 1]


def mark_aliases(stablehlo: str, aliases: dict[int, int]) -> str:
    """``stablehlo`` with argument ``a`` of ``main`` donated to output ``aliases[a]`` (``tf.aliasing_output``, the
    attribute JAX writes for donated buffers; the compiler turns it into an input-output alias)."""
    start, end, head = _main_signature(stablehlo)
    marked = set()

    def mark(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if index not in aliases:
            return match.group(0)
        marked.add(index)
        attribute = f"tf.aliasing_output = {int(aliases[index])} : i32"
        if match.group(3):
            if "tf.aliasing_output" in match.group(3):
                raise ValueError(f"StableHLO argument %arg{index} is already aliased")
            return f"%arg{index}: tensor<{match.group(2)}> {{{attribute}, {match.group(3)[2:]}"
        return f"%arg{index}: tensor<{match.group(2)}> {{{attribute}}}"

    head = _ARGUMENT.sub(mark, head)
    missing = sorted(set(aliases) - marked)
    if missing:
        raise ValueError(f"the StableHLO main function has no arguments {missing} to alias")
    return stablehlo[:start] + head + stablehlo[end:]


_MODULE = re.compile(r"^module @[\w.$-]+ attributes \{", re.MULTILINE)
_RESULT = re.compile(r"tensor<[^>]*>( \{[^{}]*\})?")


def _annotate_shardings(stablehlo: str, arguments: list[str], results: dict[int, str], partitions: int) -> str:
    """``stablehlo`` for ``partitions`` chips: ``mhlo.sharding`` on every argument of ``main`` and on every result
    (``results[i]``, else whole: ``{replicated}``), and the partition count on the module."""
    start, end, head = _main_signature(stablehlo)

    def argument(match: re.Match[str]) -> str:
        attribute = f'mhlo.sharding = "{arguments[int(match.group(1))]}"'
        if match.group(3):
            return f"%arg{match.group(1)}: tensor<{match.group(2)}> {{{attribute}, {match.group(3)[2:]}"
        return f"%arg{match.group(1)}: tensor<{match.group(2)}> {{{attribute}}}"

    head = _ARGUMENT.sub(argument, head)
    if not stablehlo.startswith(" -> ", end + 1):
        raise ValueError("the StableHLO main function has no results to shard")
    stop = stablehlo.index(" {\n", end)
    count = iter(range(1 << 30))

    def result(match: re.Match[str]) -> str:
        if match.group(1):
            raise ValueError("the StableHLO main function's results already carry attributes")
        return f'{match.group(0)} {{mhlo.sharding = "{results.get(next(count), "{replicated}")}"}}'

    tail = _RESULT.sub(result, stablehlo[end:stop])
    text = stablehlo[:start] + head + tail + stablehlo[stop:]
    module = _MODULE.search(text)
    if module is None:
        raise ValueError("the StableHLO module has no attributes to put the partition count in")
    count_attributes = f"mhlo.num_partitions = {partitions} : i32, mhlo.num_replicas = 1 : i32, "
    return text[: module.end()] + count_attributes + text[module.end() :]


class _Storage:
    """Gives meta tensors device storage: zero-copy over untouched host memory, or (``zero_copy=False``, the
    ordinary way) real zero-filled tensors copied to the device."""

    def __init__(self, device: torch.device, zero_copy: bool) -> None:
        self.device, self.zero_copy = device, zero_copy

    def __call__(self, like: torch.Tensor) -> torch.Tensor:
        if not self.zero_copy:
            return torch.zeros(like.shape, dtype=like.dtype).to(self.device)
        host = torch.empty(like.shape, dtype=like.dtype)
        return backends.zero_copy_device_tensor(host, self.device)


def _materialize(module: torch.nn.Module, storage: _Storage) -> None:
    """Give every meta parameter and buffer of ``module`` device storage, in place (shared ones stay shared)."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in memo:
                    made = storage(tensor)
                    if isinstance(tensor, torch.nn.Parameter):
                        made = torch.nn.Parameter(made, requires_grad=tensor.requires_grad)
                    memo[id(tensor)] = made
                table[key] = memo[id(tensor)]  # type: ignore[assignment]  # a Parameter where one was


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of ``module`` device storage over untouched host memory, in place
    (nothing allocated or copied; shared parameters stay shared)."""
    _materialize(module, _Storage(device, zero_copy=True))


def device_data(spec: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Device data of ``spec``'s shape and dtype over untouched host memory (a meta tensor gives the shape)."""
    return _Storage(device, zero_copy=True)(spec)


def _named_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[tuple[str, str, torch.Tensor, Callable[[torch.Tensor], None]]]:
    """(role, name, tensor, setter) of every parameter, buffer and optimizer-state tensor the step may update."""
    found: list[tuple[str, str, torch.Tensor, Callable[[torch.Tensor], None]]] = []
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        names[id(param)] = name

        def set_param(new: torch.Tensor, param: torch.Tensor = param) -> None:
            param.data = new

        found.append((PARAMETERS, name, param, set_param))
    for qualified, buf in model.named_buffers(remove_duplicate=True):
        owner_name, _, key = qualified.rpartition(".")
        owner = model.get_submodule(owner_name)

        def set_buffer(new: torch.Tensor, owner: torch.nn.Module = owner, key: str = key) -> None:
            owner._buffers[key] = new

        found.append((BUFFERS, qualified, buf, set_buffer))
    if optimizer is not None:
        for i, (key_param, state) in enumerate(optimizer.state.items()):
            if not isinstance(state, dict):
                continue
            owner_name = names.get(id(key_param), f"state {i}")
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor):
                    continue

                def set_state(new: torch.Tensor, state: dict = state, key: Any = key) -> None:
                    state[key] = new

                found.append((OPTIMIZER, f"{owner_name}.{key}", value, set_state))
    return found


def trace_step(
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer | None] | None,
    make_step: Callable[[torch.nn.Module, torch.optim.Optimizer | None], Callable[..., Any]],
    inputs: Sequence[torch.Tensor],
    *,
    device: backends.DeviceLike = "xla",
    zero_copy: bool = True,
) -> TracedStep:
    """Trace the steady-state training step of ``model`` at full size and return its program (see the module
    docstring).

    ``model``: built on the ``meta`` device (tensors already elsewhere stay where they are); it is given device
    storage in place. ``make_optimizer(model)``: its optimizer (or ``None``), built after the parameters have
    storage. ``make_step(model, optimizer)``: the step function, called with ``inputs``; it runs forward,
    backward and the optimizer update and returns the loss (or any tensors). ``inputs``: meta tensors standing for
    the batch (their shapes and dtypes are used).

    ``zero_copy=False`` traces the ordinary way instead: real zero-filled tensors copied to the device, and the
    first step executed (so the optimizer state is real device data) before the second is traced. The two programs
    are the same; the zero-copy one needs no memory (this is what the tests check).
    """
    dev = backends.device_for(str(device)) if isinstance(device, str) else backends.as_device(device)
    if not backends.backend_for(dev).program_text_available:
        raise ValueError(f"trace_step traces a program for the TPU compiler on an XLA device, not on {dev}")
    storage = _Storage(dev, zero_copy)
    _materialize(model, storage)
    batch = []
    for i, spec in enumerate(inputs):
        if not isinstance(spec, torch.Tensor):
            raise TypeError(f"trace_step inputs are meta tensors giving shapes and dtypes; input {i} is {spec!r}")
        batch.append(storage(spec))
    optimizer = make_optimizer(model) if make_optimizer is not None else None
    step = make_step(model, optimizer)
    try:
        with contextlib.ExitStack() as stack:
            if zero_copy:  # traced for a TPU: host placements annotated as there, stages measured without running
                stack.enter_context(backends.host_annotations(True))
                stack.enter_context(tracing.stand_in_inputs())
            return _trace(model, optimizer, step, batch, inputs, storage, dev)
    except RuntimeError as exc:
        if "Unexpected execution" not in str(exc):
            raise
        raise RuntimeError(
            "the training step tried to run on the device while being traced for sizing (a .item(), a print of a "
            "device value, a sync or a host copy inside the step); sizing traces the step without running it: "
            "move value reads out of the step function"
        ) from None


def _trace(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: Callable[..., Any],
    batch: list[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    storage: _Storage,
    dev: torch.device,
) -> TracedStep:
    zero_copy = storage.zero_copy
    roles: dict[int, tuple[str, str]] = {}
    host_stepping = isinstance(optimizer, HostStepping)
    # The autograd engine's worker threads are not needed to trace; see memory.step_stablehlo.
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(tracing.checks_suspended())  # the program is the step's own (no rebuild check)
        # A host-stepping optimizer's step is traced as its device part: its gradients, sent to the host.
        sent = stack.enter_context(optimizer.device_part_only()) if host_stepping else []  # type: ignore[union-attr]
        # The first step may read small values (the recompute engine compares a unit's buffers with copies once,
        # as kernels may update buffers without bumping their version); the traced step below never runs.
        step(*batch)
        sent.clear()
        if zero_copy:  # fresh storage: drop the first step's graph; the second starts from device data
            for _, _, tensor, setter in _named_state(model, optimizer):
                if backends.is_tracing_lazily(tensor) and not _plain_data(tensor):
                    setter(storage(tensor))
            batch = [storage(spec) for spec in inputs]
        else:
            backends.sync(dev)
        for i, tensor in enumerate(batch):
            roles[backends.data_identity(tensor)] = (INPUTS, f"input {i}")
        before = {}  # Python object -> its device data's identity, for what the step updates in place
        for role, name, tensor, _ in _named_state(model, optimizer):
            if backends.is_tracing_lazily(tensor):
                before[id(tensor)] = backends.data_identity(tensor)
                roles.setdefault(before[id(tensor)], (role, name))
        with tracing.execution_forbidden(dev):
            result = step(*batch)
            traced = _program(result, _named_state(model, optimizer), roles, before, sent)
    host = optimizer.host_state_bytes() if host_stepping else 0  # type: ignore[union-attr]
    return dataclasses.replace(traced, host_bytes=host)


def _plain_data(tensor: torch.Tensor) -> bool:
    """Whether a lazy tensor holds device data with nothing pending (a buffer the step does not change keeps its
    object, so engines that watch buffers by identity see the same one)."""
    return backends.program_arguments([tensor]) == [backends.data_identity(tensor)]


def _program(
    result: Any,
    updated: Iterable[tuple[str, str, torch.Tensor, Any]],
    roles: dict[int, tuple[str, str]],
    before: dict[int, int],
    sent: Sequence[torch.Tensor] = (),
) -> TracedStep:
    """The program computing the step's result, the tensors ``sent`` to the host and every updated tensor; a
    tensor updated in place (the same object as before the step) is donated the buffer of the argument it started
    from, as torch_xla does."""
    outputs: list[torch.Tensor] = []
    names: list[str] = []
    seen: set[int] = set()
    results = [t for t in tensor_leaves(result) if backends.is_tracing_lazily(t)]
    if not results:
        raise ValueError("the traced step returned no device tensor (return the loss)")
    for i, tensor in enumerate(results):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            outputs.append(tensor)
            names.append("loss" if i == 0 else f"result {i}")
    for i, tensor in enumerate(sent):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            outputs.append(tensor)
            names.append(f"gradient to host {i}")
    donors: dict[int, int] = {}  # data identity -> output index
    for role, name, tensor, _ in updated:
        if not backends.is_tracing_lazily(tensor) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        identity = before.get(id(tensor))
        if identity is not None and _plain_data(tensor) and backends.data_identity(tensor) == identity:
            continue  # unchanged (a host-stepped optimizer's weights): no output, which would be a copy of it
        if identity is not None and roles.get(identity, (None,))[0] == role and identity not in donors:
            donors[identity] = len(outputs)
        outputs.append(tensor)
        names.append(name)
    text = backends.lazy_stablehlo(outputs)
    identities = backends.program_arguments(outputs)
    sizes = stablehlo_arguments(text)
    if len(sizes) != len(identities):
        raise RuntimeError(
            f"the traced program has {len(sizes)} arguments but torch_xla lists {len(identities)} device data"
        )
    arguments = []
    for index, (identity, (shape, dtype, nbytes)) in enumerate(zip(identities, sizes)):
        role, name = roles.get(identity, (OTHER, f"argument {index}"))
        arguments.append(StepArgument(index, role, name, shape, dtype, nbytes, donors.get(identity)))
    aliases = {a.index: a.output for a in arguments if a.output is not None}
    return TracedStep(
        stablehlo=mark_aliases(text, aliases),
        unaliased_stablehlo=text,
        arguments=tuple(arguments),
        outputs=tuple(names),
    )
