"""What a recomputed forward must see again: one place for the engines that run a forward a second time in the
backward pass (the reversible core, ``Checkpointable``'s executor, ``OffloadModel``'s checkpointed slices).

A unit (a reversible layer, a planned stage, an offloaded slice) that is recomputed must compute what its first run
computed. Three things can differ between the two runs, and each is handled here:

* **Random numbers**, two ways (:func:`random_numbers`). ``"plain"`` (the default, on devices whose random
  operators take generators: cpu, cuda): each unit's first run draws from torch's global generators exactly as the
  plain model draws (nothing else is drawn), its random state is captured just before, and a recomputation runs
  from that state with the global generators put back after it (as ``torch.utils.checkpoint`` does): dropout masks,
  losses and the generators' state after a step equal the plain model's, so a seeded run and a resumed one continue
  as the plain model's do. Another thread drawing from the global generators during a recomputation would share its
  numbers. ``"own"``: a call draws one seed from torch's global generator (:func:`backends.draw_seed`, one atomic
  draw), and unit ``i`` runs under ``derive_seed(seed, i)``, in its first run and in every recomputation. Within
  :func:`rng_scope` the random operators of the running thread are handed generators that the scope owns (a
  dispatch rule that only that thread sees, below autograd), so nothing seeds, saves or restores the process-global
  generators: another thread, using this library or plain torch, may draw from them meanwhile without changing this
  thread's numbers or having its own changed. On xla, whose random ops draw from a per-device seed inside the graph,
  the unit seeds that device instead, which is process-global: two threads must not share an xla device. A
  block's own ``torch.Generator`` is started again where the forward found it and left where the
  forward left it. Python's ``random`` cannot be replayed: an engine reports a block that draws from it at its
  first training call (:meth:`RecomputeState.python_random_check`).
* **Autocast** (:class:`backends.AutocastState`): captured with the seed and replayed (:class:`CallReplay`).
* **Buffers the forward changes** (running statistics, ``spectral_norm``'s power iteration, counters).
  :class:`RecomputeState` learns which buffers a unit changes, keeps their values from before each forward
  (:class:`SavedBuffers`), gives them back to the recomputation, and puts the forward's results back once the
  recomputation's gradient has been taken, so gradients and buffers after a step are those of the plain model.
  Putting back waits for the gradient because normalization layers save their running statistics for their
  backward, and autograd refuses a saved tensor changed in between. Buffers replaced by assignment rather than
  changed in place are not tracked.
* **Merging with the forward** (lazily traced devices, XLA): a recomputation computes what the forward computed, and
  a compiler that sees both in one graph merges them and keeps the forward's activations. The reversible core and
  ``Checkpointable`` put an optimization barrier (:func:`backends.optimization_barrier`) over what a recomputation
  reads before running it; ``OffloadModel`` cuts the graph after each slice's forward and recomputation, so the two
  never share a graph.

Autocast is replayed around the recomputed forward only: gradients are taken in the ambient autocast state, as plain
autograd takes them (a block that keeps a matmul in float32 under autocast gets float32 gradients there).

Cost: a unit without buffers and random operators pays one seeding per run; each random operator pays one Python
call (a few microseconds); a unit with buffers pays a version check per buffer and a copy of the changed ones.

The buffers part lives in ``buffers.py`` (:class:`RecomputeState`, :class:`SavedBuffers`), re-exported here.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import backends
from .buffers import RecomputeState, SavedBuffers, owned_buffers

__all__ = [
    "random_numbers",
    "drawing",
    "plain_random_numbers",
    "rng_scope",
    "checkpoint",
    "CallReplay",
    "RecomputeState",
    "SavedBuffers",
    "owned_buffers",
    "preserved",
    "probe",
]

Tensor = torch.Tensor
Reseed = Callable[[int | None], None]
#: Per call, per unit seed: the generators a unit was handed by the user's code (not by the scope) and their state
#: at the unit's first draw from each in the forward, ``{seed: {id(generator): (generator, state)}}``.
GeneratorRecord = dict[int, dict[int, tuple[torch.Generator, Tensor]]]

#: a dispatch key above autograd that torch leaves unused (torchdistx had it)
DISPATCH_KEY_NAME = "DeferredInit"
_local = threading.local()
_install_lock = threading.Lock()
_installed: list[Any] = []  # [dispatch key or None, libraries kept alive]


_RANDOM_NUMBERS = ["plain"]
RANDOM_NUMBERS = ("plain", "own")


def random_numbers(mode: str | None = None) -> str:
    """How the engines that recompute (the reversible core, ``Checkpointable``, ``OffloadModel``, the exact momentum
    stack) draw random numbers, process-wide: ``"plain"`` (default: the plain model's numbers, from torch's global
    generators, each recomputation replaying its unit's captured state) or ``"own"`` (generators of the engine's own,
    seeded from one draw per call: no other thread can change a recomputation's numbers, but they are not the plain
    model's). Returns the mode in force before; with no argument, changes nothing. On xla, whose random operators
    take no generator, units are seeded as in ``"own"`` either way."""
    before = _RANDOM_NUMBERS[0]
    if mode is not None:
        if mode not in RANDOM_NUMBERS:
            raise ValueError(
                f"revlib_xla.recompute.random_numbers: {mode!r}; choose one of {', '.join(RANDOM_NUMBERS)}"
            )
        _RANDOM_NUMBERS[0] = mode
    return before


@contextlib.contextmanager
def drawing(mode: str) -> Iterator[None]:
    """:func:`random_numbers` ``mode`` within the block."""
    before = random_numbers(mode)
    try:
        yield
    finally:
        random_numbers(before)


def plain_random_numbers(device: backends.DeviceLike) -> bool:
    """Whether units on ``device`` draw the plain model's random numbers now (:func:`random_numbers`)."""
    return _RANDOM_NUMBERS[0] == "plain" and backends.takes_generators(device)


def _ignore(seed: int | None) -> None:
    pass


# ----------------------------------------------------------------------------------------------------------------
# Random numbers: a thread-local rule that hands random operators the scope's generators


class _Frame:
    """One active :func:`rng_scope` of a thread: its generators (one per device, made at the first draw there),
    the current unit's seed, and the user's generators it has started again for a recomputation."""

    __slots__ = ("device_seed", "forks", "gens", "moved", "owned", "plain", "record", "replay", "seed")

    def __init__(self, device: torch.device, record: GeneratorRecord | None, replay: bool, plain: bool = False) -> None:
        self.plain = plain  # random operators keep torch's global generators (the seed is only the unit's key)
        self.gens: dict[torch.device, torch.Generator | None] = {}
        self.owned: set = set()
        self.device_seed = backends.DeviceSeed.capture(device)  # xla: the device is seeded per unit instead
        self.seed: int | None = None
        self.record, self.replay = record, replay
        self.moved: list[tuple[torch.Generator, Tensor]] = []
        self.forks = 0

    def reseed(self, seed: int | None) -> None:
        if seed is None:
            return
        if self.moved:
            self._put_back()
        self.seed, self.forks = seed, 0
        for g in self.gens.values():
            if g is not None:
                g.manual_seed(seed)
        if self.device_seed is not None:
            self.device_seed.seed(seed)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The scope's generator for ``device`` (``None``: leave the operator as it is)."""
        if self.seed is None or self.plain:
            return None
        if device in self.gens:
            return self.gens[device]
        g = self.gens[device] = backends.owned_generator(device)
        if g is not None:
            self.owned.add(id(g))
            g.manual_seed(self.seed)
        return g

    def users_generator(self, g: torch.Generator) -> None:
        """A random operator was handed ``g`` by the block: note its state at the unit's first draw (forward), or
        start it there again (recomputation)."""
        if self.record is None or self.seed is None or id(g) in self.owned:
            return
        if not self.replay:
            unit = self.record.setdefault(self.seed, {})
            if id(g) not in unit:
                unit[id(g)] = (g, g.get_state())
        elif all(m is not g for m, _ in self.moved):
            first = self.record.get(self.seed, {}).get(id(g))
            if first is not None:
                self.moved.append((g, g.get_state()))
                g.set_state(first[1])

    def _put_back(self) -> None:
        for g, state in reversed(self.moved):
            g.set_state(state)
        self.moved = []

    def close(self) -> None:
        self._put_back()
        if self.device_seed is not None:
            self.device_seed.restore()


def _frames() -> list[_Frame]:
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def _device_of(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def redispatch_below(op: Any, keyset: Any, key: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``op`` below the rule's key. Under a Python dispatch mode or on Python tensor subclasses (FakeTensorMode
    while torch.compile traces, a TorchDispatchMode) the operator is dispatched again from the start, where the
    scope's key would send it back to the rule endlessly: there it runs with the key excluded. What it calls inside
    (an attention kernel's decomposition drawing its dropout, under the attention cache's mode) then draws from
    torch's global generator, which for that call holds the state of the scope's own generator (and gets its own
    back after), so it draws what the scope's generator would, and the global stream is left as it was."""
    python = torch._C._len_torch_dispatch_stack() > 0 or any(
        isinstance(a, Tensor) and torch._C._dispatch_keys(a).has(torch._C.DispatchKey.Python)
        for a in (*args, *kwargs.values())
    )
    if not python:
        return op.redispatch(keyset.remove(key), *args, **kwargs)
    frames = getattr(_local, "frames", None)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    own = frames[-1].generator(tensors[0].device) if frames and tensors and backends.holds_data(tensors[0]) else None
    glob = backends.default_generator(tensors[0].device) if own is not None else None
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
        if own is None or glob is None:
            return op.redispatch(keyset.remove(key), *args, **kwargs)
        outside = glob.get_state()
        glob.set_state(own.get_state())
        try:
            return op.redispatch(keyset.remove(key), *args, **kwargs)
        finally:
            own.set_state(glob.get_state())
            glob.set_state(outside)


def _handing(op: Any, position: int, kwarg_only: bool, key: Any) -> Callable:
    """The rule for an operator with a ``generator`` argument: hand it the scope's generator when it has none."""

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        frames = getattr(_local, "frames", None)
        if frames:
            frame = frames[-1]
            given = kwargs.get("generator") if kwarg_only or len(args) <= position else args[position]
            if given is None:
                own = frame.generator(_device_of(args, kwargs))
                if own is not None:
                    kwargs["generator"] = own  # a positional None is left out of args (defaults are dropped)
            else:
                frame.users_generator(given)
        return redispatch_below(op, keyset, key, args, kwargs)

    return kernel


def _native_dropout(key: Any) -> Callable:
    """``native_dropout`` has no generator argument (cuda's fused kernel reads the device's global generator):
    within a scope it runs as the same computation from a Bernoulli mask drawn from the scope's generator."""
    op = torch.ops.aten.native_dropout.default

    def kernel(keyset: Any, input: Tensor, p: float, train: bool | None) -> Any:
        frames = getattr(_local, "frames", None)
        own = frames[-1].generator(input.device) if frames and train is not False and input.numel() else None
        if own is None:
            return redispatch_below(op, keyset, key, (input, p, train), {})
        keep = torch.empty_like(input, dtype=torch.bool).bernoulli_(1 - p, generator=own)
        return input * keep * (1.0 / (1 - p) if p < 1 else 0.0), keep

    return kernel


def _forking(op: Any, position: int, key: Any) -> Callable:
    """Fused attention kernels with dropout (cuda) read the device's global generator and take none: they run with
    that generator seeded from the unit's seed and put back right after. Not race-free: another thread drawing on
    the same device during the kernel shares its numbers."""

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        frames = getattr(_local, "frames", None)
        p = kwargs.get("dropout_p", args[position] if len(args) > position else 0.0)
        device = _device_of(args, kwargs)
        frame = frames[-1] if frames else None
        glob = backends.default_generator(device) if frame is not None and p and frame.generator(device) else None
        if frame is None or frame.seed is None or glob is None:
            return redispatch_below(op, keyset, key, args, kwargs)
        frame.forks += 1
        state = glob.get_state()
        glob.manual_seed(backends.derive_seed(frame.seed, 1 << 20 | frame.forks))
        try:
            return redispatch_below(op, keyset, key, args, kwargs)
        finally:
            glob.set_state(state)

    return kernel


def _install() -> Any:
    """Register the thread-local rule (once per process): a fallthrough for every operator at an unused dispatch
    key, and a Python kernel there for each random operator. Returns the key, or ``None`` where this torch cannot
    (then scopes reseed the global generators, as torch's own checkpointing does, and warn that it is not
    thread-safe)."""
    if _installed:
        return _installed[0]
    with _install_lock:
        if _installed:
            return _installed[0]
        try:
            key = torch._C._parse_dispatch_key(DISPATCH_KEY_NAME)
            passthrough = torch.library.Library("_", "IMPL")
            passthrough.fallback(torch.library.fallthrough_kernel, dispatch_key=DISPATCH_KEY_NAME)
            rules = torch.library.Library("aten", "IMPL")
            routed = {str(op) for op in _register_rules(rules, key)}
            missing = {"aten.bernoulli_.float", "aten.uniform_.default", "aten.normal_.default"} - routed
            if missing:
                raise RuntimeError(f"no rule for {sorted(missing)}")
            rules.impl(torch.ops.aten.native_dropout.default, _native_dropout(key), DISPATCH_KEY_NAME, with_keyset=True)
            _installed[:] = [key, (passthrough, rules)]
        except Exception as exc:  # a torch without these internals: fall back, loudly
            warnings.warn(
                f"revlib_xla: cannot hand random operators their own generators on torch "
                f"{torch.__version__} ({type(exc).__name__}: {exc}); recomputations replay random numbers "
                f"by reseeding torch's global generators, which is not safe while another thread draws "
                f"from them",
                RuntimeWarning,
                stacklevel=3,
            )
            _installed[:] = [None, ()]
    return _installed[0]


def _register_rules(rules: Any, key: Any) -> Iterator[Any]:
    """Register the rule of every aten operator with a ``generator`` argument, and of the fused attention kernels
    with dropout; yields the operators. An operator this torch cannot resolve is skipped."""
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name.partition(".")
        try:
            arguments = torch._C._get_schema(base, overload).arguments
            names = [a.name for a in arguments]
            if "generator" not in names and (
                "dropout_p" not in names
                or base.endswith("_backward")
                or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
            ):
                continue
            op = getattr(getattr(torch.ops.aten, base[len("aten::") :]), overload or "default")
            if "generator" in names:
                k = names.index("generator")
                rules.impl(op, _handing(op, k, arguments[k].kwarg_only, key), DISPATCH_KEY_NAME, with_keyset=True)
            elif torch.Tag.nondeterministic_seeded in op.tags:
                rules.impl(op, _forking(op, names.index("dropout_p"), key), DISPATCH_KEY_NAME, with_keyset=True)
            else:
                continue
        except Exception:
            continue
        yield op


@contextlib.contextmanager
def rng_scope(
    device: backends.DeviceLike,
    active: bool = True,
    record: GeneratorRecord | None = None,
    replay: bool = False,
    plain: bool = False,
) -> Iterator[Reseed]:
    """Yield ``reseed(seed)``: from then on, random operators of this thread draw from generators owned by the
    scope and seeded with ``seed``. One ``reseed`` per unit; given ``None``, or with ``active=False``, it does
    nothing.

    ``record``: note the state of generators the block hands its operators itself, at each unit's first draw
    from them; with ``replay=True``, start them there again for the unit and put them back after it.

    A device whose random operators cannot be handed generators (xla: a per-device seed inside the graph) is
    seeded by ``reseed`` itself, and its state put back at exit: replayed, but process-global, so two threads must
    not share such a device.

    ``plain``: random operators keep torch's global generators (the caller captures and restores their state,
    :class:`CallReplay`); ``reseed``'s argument only names the unit whose own generators are recorded or replayed.
    """
    if not active:
        yield _ignore
        return
    dev = device.device if isinstance(device, Tensor) else torch.device("cpu" if device is None else device)
    key = _install()
    if key is None and plain:
        yield _ignore
        return
    if key is None:
        saved = backends.RngState.capture(dev)
        try:
            yield lambda seed: None if seed is None else backends.manual_seed(dev, seed)
        finally:
            saved.restore()
        return
    frame = _Frame(dev, record, replay, plain)
    if plain:
        frame.device_seed = None
    frames = _frames()
    frames.append(frame)
    try:
        with torch._C._IncludeDispatchKeyGuard(key):
            yield frame.reseed
    finally:
        frames.remove(frame)  # the last one, unless scopes were left out of order
        frame.close()


def dispatch_key() -> Any:
    """The dispatch key (above autograd, included only within this module's scopes) at which the recompute engine's
    per-operator rules run (also :mod:`revlib_xla.planner.attention_cache`'s), or ``None`` where this torch cannot."""
    return _install()


def rewind(record: GeneratorRecord) -> None:
    """Put the user's generators noted in ``record`` back where the first unit found them."""
    for states in reversed(list(record.values())):
        for g, state in states.values():
            g.set_state(state)


# ----------------------------------------------------------------------------------------------------------------
# Activation checkpointing inside an engine's scope


def checkpoint(function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """:func:`revlib_xla.backends.checkpoint` that also recomputes the random numbers of an engine's scope.

    Inside a unit of an engine (a reversible layer, a planned stage), random operators draw from the scope's own
    generators, which ``torch.utils.checkpoint`` does not know: its recomputation, in the backward pass after the
    scope has moved on, would draw other dropout masks than the forward (wrong gradients). Here the first run draws
    from the scope's generator as any block does, and the recomputation draws from a generator started where that
    one stood. Outside a scope this is ``backends.checkpoint``.
    """
    frames = _frames()
    frame = frames[-1] if frames else None
    device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
    generator = frame.generator(device) if frame is not None else None
    if generator is None or not preserve_rng_state:
        return backends.checkpoint(function, *args, preserve_rng_state=preserve_rng_state)
    start = generator.get_state()
    runs = 0

    def run(*inputs: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 1:
            return function(*inputs)
        with rng_scope(device, True, None, replay=True) as reseed:
            reseed(0)  # any seed: the generator is started at the forward's state below
            own = _frames()[-1].generator(device)
            if own is not None:
                own.set_state(start)
            return function(*inputs)

    return backends.checkpoint(run, *args, preserve_rng_state=preserve_rng_state)


# ----------------------------------------------------------------------------------------------------------------
# One call's capture, for engines that enter a scope per unit


class CallReplay:
    """What one engine call's forward captured for its recomputations: how units draw random numbers
    (:func:`random_numbers`: with ``"plain"``, each unit's random state just before its first run; with ``"own"``,
    one seed, unit ``i`` running under ``derive_seed(seed, i)``; ``preserve_rng=False``: neither, units draw from
    the global generators and recomputations draw other numbers), the autocast state, and the user's generators met
    in each unit.

    Every engine takes these from here: ``Checkpointable`` and ``OffloadModel`` enter a scope per unit
    (:meth:`first_run`, :meth:`rerun`); the reversible core enters one :meth:`scope` for its whole forward, and one
    per layer in the backward, and reseeds it per layer with :meth:`unit_seed`."""

    def __init__(self, device: backends.DeviceLike, preserve_rng: bool = True) -> None:
        self.device = device
        #: the plain model's random numbers, each unit's state captured (see random_numbers)
        self.plain = preserve_rng and plain_random_numbers(device)
        self.seed = backends.draw_seed() if preserve_rng and not self.plain else None
        #: whether recomputations draw their first run's numbers
        self.preserves = preserve_rng
        self.autocast = backends.AutocastState.capture(device)
        self.record: GeneratorRecord = {}
        self.states: dict[int, backends.RngState] = {}  # plain: each unit's random state before its first run

    @staticmethod
    def held_bytes(device: backends.DeviceLike, units: int, preserve_rng: bool = True) -> int:
        """Bytes of ``device``'s memory that a call of ``units`` units holds for its recomputations' random numbers
        from its forward to the end of its backward: with ``"plain"`` random numbers, one captured state per unit
        (:meth:`backends.RngState.bytes_on`); else none (a seed is a Python integer)."""
        if not (preserve_rng and plain_random_numbers(device)):
            return 0
        return units * backends.RngState.capture(device).bytes_on(device)

    def unit_seed(self, unit: int) -> int | None:
        """The seed unit ``unit`` runs under, in its first run and in every recomputation (plain: the unit itself,
        the key of its captured state)."""
        if self.plain:
            return unit
        return None if self.seed is None else backends.derive_seed(self.seed, unit)

    def scope(self, replay: bool = False) -> contextlib.AbstractContextManager[Reseed]:
        """An :func:`rng_scope` for several units of this call (``reseed(self.unit_seed(i))`` before unit ``i``):
        the first runs (recording the user's generators), or with ``replay=True`` recomputations (starting them
        again where each unit found them). Autocast is not entered: see :meth:`rerun`."""
        if self.plain:
            return self._plain_scope(replay)
        return rng_scope(self.device, self.seed is not None, self.record, replay)

    @contextlib.contextmanager
    def _plain_scope(self, replay: bool) -> Iterator[Reseed]:
        """Plain random numbers: ``reseed(unit)`` captures the global generators' state before the unit's first run
        (which then draws from them as the plain model does), or for a unit run before (a recomputation, a forward
        phase run again) starts them at that state; at exit they are put back where the scope found them if any unit
        was run again there."""
        device = backends.as_device(self.device)
        now = backends.RngState.capture(device)
        again = [False]
        with rng_scope(device, True, self.record, replay, plain=True) as frame_reseed:

            def reseed(unit: int | None) -> None:
                if unit is None:
                    return
                frame_reseed(unit)
                state = self.states.get(unit)
                if state is None and not replay:
                    self.states[unit] = backends.RngState.capture(device)
                elif state is not None:
                    again[0] = True
                    state.restore()

            try:
                yield reseed
            finally:
                if again[0]:
                    now.restore()

    @contextlib.contextmanager
    def first_run(self, unit: int) -> Iterator[None]:
        """The unit's random numbers, recorded; no autocast weight-cast cache (:func:`backends.autocast_cache_off`:
        a first run without autograd would leave casts without history for a later run with it)."""
        with self.scope() as reseed, backends.autocast_cache_off():
            reseed(self.unit_seed(unit))
            yield

    @contextlib.contextmanager
    def rerun(self, unit: int) -> Iterator[None]:
        """The unit's random numbers and the forward's autocast state, for a recomputation."""
        with self.scope(replay=True) as reseed, self.autocast.replay():
            reseed(self.unit_seed(unit))
            yield


@contextlib.contextmanager
def preserved(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Within the block ``tensors`` may change; at exit they hold their values from entry again."""
    with torch.no_grad():
        copies = [t.clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, c in zip(tensors, copies):
                t.copy_(c)


@contextlib.contextmanager
def probe(device: backends.DeviceLike, buffers: Sequence[Tensor], seed: int) -> Iterator[None]:
    """Run blocks without leaving a trace (measuring them, checking an inverse): random numbers from generators
    seeded with ``seed``, and the buffers and the blocks' own generators put back at exit."""
    record: GeneratorRecord = {}
    try:
        with preserved(buffers), rng_scope(device, record=record) as reseed:
            reseed(seed)
            yield
    finally:
        rewind(record)
