"""How every command-line program of physis_ros ends when something is wrong: one line on
stderr that names the problem and the fix, and an exit status that says whose it is.

Exit status: 0 done, 1 a runtime failure (the environment or the work failed: a port taken,
a server that went away, nothing to score), 2 a usage or configuration error (a flag, a
config file, a weights file, a path: the user fixes the command), 130 interrupted (Ctrl-C,
SIGTERM; a server that stops on them exits 0: that is how it is stopped). No traceback
unless ``--debug`` is on the command line (it is taken out before the program parses its
arguments) or ``PHYSIS_DEBUG=1`` is set (children inherit it).

Programs raise ``UsageError`` / ``RuntimeFailure`` with a fix where they know one; anything
else that escapes ``main`` is classified here by type. No torch, no rclpy: both sides use it.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import fields
from typing import Any, get_args, get_origin, get_type_hints

DEBUG_FLAG = "--debug"
DEBUG_ENV = "PHYSIS_DEBUG"
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A fault the program can describe: ``problem`` and, where known, ``fix``."""

    exit_code = EXIT_RUNTIME

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


class UsageError(CliError, ValueError):
    """A flag, config value, or input file is wrong: exit 2. (A ValueError, so code that
    checks values keeps working when it raises one.)"""

    exit_code = EXIT_USAGE


class RuntimeFailure(CliError):
    """The work could not be done (environment, network, peers): exit 1."""

    exit_code = EXIT_RUNTIME


def ignore_further_interrupts() -> None:
    """Once a program is stopping, SIGINT is spent and SIGTERM is a hard stop. Ctrl-C under
    ``ros2 launch`` signals the whole process group and launch then signals each process
    again; that second SIGINT killed a program mid-teardown, or after it had stopped, when
    Python had put SIG_DFL back at exit (exit -2 instead of 0). SIG_IGN survives interpreter
    exit. SIGTERM is what ``ros2 launch`` sends when SIGINT did not end a process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe(exc: BaseException, prog: str) -> tuple[int, str]:
    """(exit status, the one line) for an exception that ended ``prog``."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, f"{prog}: interrupted"
    if isinstance(exc, CliError):
        code, problem, fix = exc.exit_code, exc.problem, exc.fix
    elif type(exc).__module__.startswith("yaml"):
        code, problem = EXIT_USAGE, f"invalid YAML: {exc}"
        fix = "correct the file (a YAML linter shows the line)"
    elif isinstance(exc, FileExistsError):
        code, problem = EXIT_USAGE, f"{exc.filename or exc} already exists"
        fix = "choose another path or remove it first"
    elif isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        code, problem = EXIT_USAGE, f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
        fix = "check the path given on the command line or in the config file"
    elif isinstance(exc, PermissionError):
        code, problem = EXIT_USAGE, f"permission denied: {exc.filename or exc}"
        fix = "check the file's permissions or run as a user who may read it"
    elif isinstance(exc, ValueError):
        code, problem, fix = EXIT_USAGE, str(exc), f"correct the value (see {prog} --help)"
    elif isinstance(exc, ImportError):
        code, problem = EXIT_RUNTIME, f"missing module: {exc}"
        fix = "install the package with the extras this command needs (see README)"
    elif isinstance(exc, OSError):
        code, problem = EXIT_RUNTIME, f"{type(exc).__name__}: {exc}"
        fix = f"rerun with {DEBUG_FLAG} for the traceback"
    else:
        code, problem = EXIT_RUNTIME, f"internal error: {type(exc).__name__}: {exc}"
        fix = f"rerun with {DEBUG_FLAG} and report the traceback"
    line = f"{prog}: error: {_one_line(problem)}"
    if fix:
        line += f" (fix: {_one_line(fix)})"
    return code, line


def run_main(prog: str, main: Callable[[list[str] | None], int | None], argv=None) -> int:
    """Runs ``main(argv)`` and turns whatever escapes into one line and an exit status.
    ``--debug`` is taken out of ``argv`` (of ``sys.argv`` when argv is None) first."""
    if argv is None:
        if DEBUG_FLAG in sys.argv[1:]:
            sys.argv[1:] = [a for a in sys.argv[1:] if a != DEBUG_FLAG]
            os.environ[DEBUG_ENV] = "1"
    else:
        argv = list(argv)
        if DEBUG_FLAG in argv:
            argv = [a for a in argv if a != DEBUG_FLAG]
            os.environ[DEBUG_ENV] = "1"
    if not debug_enabled():
        # gRPC's C core logs handshake and bind failures on its own; the line below says why.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    saved_error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _one_line_usage_error  # every parser of this program
    try:
        return int(main(argv) or 0)
    except SystemExit:
        raise  # argparse's exit (2 for usage, 0 for --help), already explained
    except BaseException as exc:  # noqa: BLE001 - every fault ends in one line and a status
        code, line = describe(exc, prog)
        if debug_enabled():
            traceback.print_exc()
        print(line, file=sys.stderr, flush=True)
        return code
    finally:
        argparse.ArgumentParser.error = saved_error


def _one_line_usage_error(parser: argparse.ArgumentParser, message: str):
    """argparse's ``error`` without the usage block: one line, exit 2."""
    parser.exit(
        EXIT_USAGE,
        f"{parser.prog}: error: {_one_line(message)} (fix: see {parser.prog.split()[0]} --help)\n",
    )


def cli_main(prog: str):
    """Decorator for a console script's ``main(argv=None)``: see ``run_main``."""

    def wrap(main):
        @functools.wraps(main)
        def wrapped(argv=None):
            return run_main(prog, main, argv)

        return wrapped

    return wrap


# ---- values from the command line and config files ----------------------------------------


def finite_float(text: str) -> float:
    """argparse ``type=``: a finite float (NaN and infinity refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """argparse ``type=``: a logging level name, any case."""
    name = text.upper()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return name


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` (from YAML) fits the annotation ``hint`` (int, float, bool, str,
    tuple, X | None; anything else is not checked here)."""
    if hint is Any:
        return True
    origin = get_origin(hint)
    if origin is not None and type(None) in get_args(hint):  # X | None
        return value is None or any(
            _accepts(h, value) for h in get_args(hint) if h is not type(None)
        )
    if origin in (tuple, list):
        return isinstance(value, list | tuple)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def check_fields(cls, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` for the dataclass ``cls``, checked before it is built: every key a field,
    every value of the field's type, every float finite. Raises UsageError naming ``where``
    (e.g. "config/serve.yaml: frontend"), the key and what it should be."""
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(
            f"{where}: unknown key(s) {unknown}",
            f"remove or correct them; known keys: {', '.join(sorted(known))}",
        )
    for key, value in values.items():
        hint = hints.get(key, Any)
        if not _accepts(hint, value):
            raise UsageError(
                f"{where}: {key} is {value!r} ({type(value).__name__})",
                f"give a value of type {getattr(hint, '__name__', hint)}",
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{where}: {key} is {value}", "give a finite number")
    return values


def refuse_unused_flags(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    mode: str,
    uses: Mapping[str, Collection[str]],
) -> None:
    """Refuses a flag given on the command line that the chosen ``mode`` does not use.

    ``uses`` maps every mode of the program (how it is described to the user, e.g.
    ``"--experiment depth"``) to the argparse destinations of the flags that only some modes
    use; a flag that no mode lists is used by every mode and never refused here. A flag
    counts as given when its value differs from the parser's default. Raises UsageError
    ``"--X is not used by MODE: it applies to OTHER MODES"``."""
    if mode not in uses:
        raise KeyError(f"mode {mode!r} is not one of {sorted(uses)}")
    specific = set().union(*uses.values())
    for dest in sorted(specific - set(uses[mode])):
        value, default = getattr(args, dest, None), parser.get_default(dest)
        if value == default or (default is None and value == []):  # nargs="*" given nothing
            continue
        flag = _flag_name(parser, dest)
        applies = " or ".join(other for other, used in uses.items() if dest in used)
        raise UsageError(f"{flag} is not used by {mode}: it applies to {applies}", f"drop {flag}")


def _flag_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """How the user writes the argument whose destination is ``dest``: its long option, or
    a positional argument's name."""
    for action in parser._actions:  # argparse lists its arguments nowhere public
        if action.dest == dest:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if longs or action.option_strings:
                return (longs or action.option_strings)[0]
            return str(action.metavar or dest).upper()
    return f"--{dest.replace('_', '-')}"
