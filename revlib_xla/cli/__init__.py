"""The ``revlib-xla`` command: ``train``, ``memory`` and ``plan`` subcommands.

Each subcommand lives in a module of this package (``revlib_xla/cli/<name>.py``) that defines
``add_arguments(parser)`` and ``run(args) -> int``; the dispatcher imports it only when it is asked for, so
``revlib-xla --help`` stays fast and a subcommand's optional dependencies are needed only by that subcommand.

Errors a user can cause (a bad config key, an unknown chip, an unsupported strategy combination, an ``out_dir`` in
use by another run, checkpoints of another model) are printed as one line, ``revlib-xla <command>: error:
<message>``, with exit status 2 and no traceback; a run that fails on its own (the loss went NaN, no checkpoint can
be resumed from or written) the same way with exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

__all__ = ["COMMANDS", "TPU_SIZING", "UsageError", "long_running", "main", "missing_modules"]

COMMANDS: dict[str, str] = {
    "train": "train a model from a config (tpu_configs/*.yaml) with a memory strategy",
    "memory": "will it fit? per-chip HBM of the training step, per strategy, from the deviceless TPU compiler",
    "plan": "the planner's checkpointing schedule for a memory budget, with its predicted time and memory",
}
"""The subcommands, each with its one-line description."""


LONG_RUNNING = ("memory", "plan")
"""The commands that show progress and clean up when stopped (:func:`long_running`)."""


class UsageError(ValueError):
    """An error in what the user asked for; the CLI prints its message without a traceback."""


_USER_ERRORS = (
    ("revlib_xla.train.config", "ConfigError"),
    ("revlib_xla.train.strategy", "StrategyError"),
    ("revlib_xla.train.rundir", "RunDirError"),
    ("revlib_xla.train.checkpoint", "CheckpointMismatch"),
)
_RUN_FAILURES = (("revlib_xla.train.loop", "DivergedError"), ("revlib_xla.train.checkpoint", "CheckpointError"))


TPU_SIZING = ("torch_xla", "jax", "jaxlib", "libtpu")
"""What sizing a step for a TPU without one needs: torch_xla traces it, the TPU compiler (libtpu, through jax)
compiles it deviceless."""


def missing_modules(names: Sequence[str] = TPU_SIZING) -> list[str]:
    """Those of ``names`` not installed here (looked up, not imported)."""
    import importlib.util

    return [name for name in names if importlib.util.find_spec(name) is None]


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    """The exception classes ``names`` lists among the modules imported so far."""
    errors: list[type[BaseException]] = []
    for module, name in names:
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            errors.append(getattr(loaded, name))
    return tuple(errors)


class _Stopped(SystemExit):
    """SIGTERM or SIGHUP, raised where the command stands so that it unwinds."""


@contextlib.contextmanager
def long_running(command: str) -> Iterator[None]:
    """For a command that sizes steps for minutes (``memory``, ``plan``): progress lines on stderr
    (:mod:`revlib_xla.fit.progress`), and SIGTERM or SIGHUP end it as Ctrl-C does, by unwinding, so that its
    temporary directories (the compiler's ``revlib_xla_tpu_*``) are deleted and its compiler process stopped,
    instead of being killed where it stands. Stopped, it says so in one line and exits 128 + the signal's number."""
    from ..fit import progress

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)} if main_thread else {}
    try:
        with progress.shown():
            yield
    except (KeyboardInterrupt, _Stopped) as exc:
        number = int(exc.code) if isinstance(exc, _Stopped) else int(signal.SIGINT)  # type: ignore[arg-type]
        print(f"revlib-xla {command}: stopped by {signal.Signals(number).name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + number) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _user_errors() -> tuple[type[BaseException], ...]:
    return (UsageError, *_loaded(_USER_ERRORS))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="revlib-xla",
        description="Train PyTorch models that do not fit in accelerator memory, and find out what fits.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``revlib-xla`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] not in COMMANDS:
        parser.parse_args(args)  # prints usage (and exits 2), or help (exits 0)
        return 2
    command = args[0]
    module = importlib.import_module(f"revlib_xla.cli.{command}")
    sub = argparse.ArgumentParser(prog=f"revlib-xla {command}", description=COMMANDS[command])
    module.add_arguments(sub)
    parsed = sub.parse_args(args[1:])
    try:
        with long_running(command) if command in LONG_RUNNING else contextlib.nullcontext():
            return int(module.run(parsed))
    except _user_errors() as exc:
        print(f"revlib-xla {command}: error: {exc}", file=sys.stderr)
        return 2
    except _loaded(_RUN_FAILURES) as exc:
        print(f"revlib-xla {command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
