"""What the command-line tools share: the user-facing error, checks of option values, the
``--set NAME.KEY=VALUE`` overrides checked against a table of settings, and small CLI helpers.

Every tool checks all of its options and ``--set`` values before it starts any work: a bad value
is a :class:`DemoError`, printed as ``PROG: error: MESSAGE`` (exit status 2), naming the option
or key and the value.
"""
from __future__ import annotations

import ast
import argparse
import contextlib
import math
import os
import re
import sys
import tempfile
from typing import Any, Iterator, Mapping

import torch


class DemoError(Exception):
    """A user-facing error of a tool (bad option, missing optional dependency): the tool prints
    ``PROG: error: MESSAGE`` on stderr and exits with status 2."""


# --------------------------------------------------------------------------------------------
# checks of one value
# --------------------------------------------------------------------------------------------
class Check:
    """A check of one value: ``check(value)`` returns the value (normalized) or raises
    ValueError whose message is what was expected (``expected``). ``text``: the value is text,
    so a ``--set`` VALUE is taken as written rather than as a Python literal."""

    expected = "a value"
    text = False

    def __call__(self, value: Any) -> Any:
        raise NotImplementedError


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


class Number(Check):
    """A finite number (an ``int`` with ``integer``; never a bool) in a range: ``lo``/``hi``
    bounds, closed unless ``lo_open``/``hi_open``."""

    def __init__(self, lo: float | None = None, hi: float | None = None, *,
                 lo_open: bool = False, hi_open: bool = False, integer: bool = False) -> None:
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.integer = integer
        what = "an integer" if integer else "a finite number"
        if lo is not None and hi is not None:
            rng = f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {_fmt(lo)}"
        elif hi is not None:
            rng = f"{'<' if hi_open else '<='} {_fmt(hi)}"
        else:
            rng = ""
        self.expected = f"{what} {rng}".rstrip()

    def __call__(self, value: Any) -> Any:
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(self.expected)
        if isinstance(value, float) and not math.isfinite(value):  # (an int is finite)
            raise ValueError(self.expected)
        lo, hi = self.lo, self.hi
        if lo is not None and (value < lo or (self.lo_open and value == lo)):
            raise ValueError(self.expected)
        if hi is not None and (value > hi or (self.hi_open and value == hi)):
            raise ValueError(self.expected)
        return value


class Choice(Check):
    """One of a fixed set of strings."""

    text = True

    def __init__(self, *options: str) -> None:
        self.options = options
        self.expected = "one of " + ", ".join(map(repr, options))

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, str) or value not in self.options:
            raise ValueError(self.expected)
        return value


class Text(Check):
    """A non-empty string."""

    text = True
    expected = "a non-empty string"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(self.expected)
        return value


class Pair(Check):
    """A pair ``(a, b)`` (tuple or list), each item passing ``item``; returned as a tuple."""

    def __init__(self, item: Check, names: str = "a, b") -> None:
        self.item = item
        self.expected = f"a pair ({names}), each {item.expected}"

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(self.expected)
        try:
            return tuple(self.item(v) for v in value)
        except ValueError:
            raise ValueError(self.expected) from None


# A seed of torch / numpy generators (the tools also use seed + 1 and seed + 2).
SEED = Number(0, 2 ** 32 - 1, integer=True)
# Epoch counts (run length, warm-up): far beyond any useful run, small enough that steps stay
# finite numbers.
MAX_EPOCHS = 10 ** 6
# Big batches per noise-scale probe: the probe's EMA coefficient 1 - 1/(100 windows) must stay
# below 1 in floating point.
PROBE_WINDOWS = Number(2, 10 ** 6, integer=True)


def threads_check() -> Number:
    """``--threads``: at least 1, at most the machine's CPU count."""
    return Number(1, os.cpu_count() or 1, integer=True)


def check_option(option: str, value: Any, check: Check, note: str = "") -> Any:
    """``check(value)``, or a DemoError ``OPTION VALUE: expected ...`` (``note`` appended)."""
    try:
        return check(value)
    except ValueError as e:
        raise DemoError(f"{option} {value!r}: expected {e}" + (f" ({note})" if note else "")) \
            from None


# --------------------------------------------------------------------------------------------
# --set NAME.KEY=VALUE
# --------------------------------------------------------------------------------------------
def parse_value(text: str, check: Check) -> Any:
    """A ``--set`` VALUE: as a Python literal (``2``, ``1e-3``, ``(0.9, 0.999)``), else as the
    string itself; as written for a text setting. Then ``check``ed (ValueError if it fails)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = text
    if check.text and not isinstance(value, str):
        value = text
    return check(value)


def parse_overrides(items: list[str], table: dict[str, dict[str, Any]], *, what: str,
                    example: str, settings: Mapping[str, Check], fixed: tuple[str, ...] = (),
                    optional: tuple[str, ...] = ()) -> None:
    """Apply ``--set NAME.KEY=VALUE`` overrides to ``table[NAME][KEY]``, each VALUE read by
    :func:`parse_value` and checked by ``settings[KEY]``. ``what`` names the entries in messages
    ("run", "optimizer"). A KEY must be one the entry has, or one of ``optional``, and not one of
    ``fixed``. Raises DemoError naming the item for anything else."""
    for item in items:
        key, eq, value = item.partition("=")
        name, dot, field = key.partition(".")
        if not eq or not dot:
            raise DemoError(f"--set {item!r}: expected {what.upper()}.KEY=VALUE, e.g. {example}")
        if name not in table:
            raise DemoError(f"--set {item!r}: unknown {what} {name!r}; expected one of "
                            f"{list(table)}")
        entry = table[name]
        keys = [k for k in [*entry, *(k for k in optional if k not in entry)] if k not in fixed]
        if field in fixed and field in entry:
            raise DemoError(f"--set {item!r}: {name}.{field} cannot be set (it is "
                            f"{entry[field]!r}); the settings of {name}: {keys}")
        if field not in keys:
            raise DemoError(f"--set {item!r}: {name} has no setting {field!r}; expected one of "
                            f"{keys}")
        try:
            entry[field] = parse_value(value, settings[field])
        except ValueError as e:
            raise DemoError(f"--set {item!r}: {field} {value!r}: expected {e}") from None


def check_table(table: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Check],
                what: str) -> None:
    """Every value of every entry passes its setting's check (for the tools' own tables)."""
    for name, entry in table.items():
        for key, value in entry.items():
            try:
                settings[key](value)
            except (KeyError, ValueError) as e:
                raise AssertionError(f"{what} {name}: {key}={value!r}: {e}") from None


# --------------------------------------------------------------------------------------------
# other options
# --------------------------------------------------------------------------------------------
def parse_device(option: str, text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` of a CUDA device this machine has."""
    if text not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", text):
        raise DemoError(f"{option} {text!r}: expected cpu, cuda or cuda:N")
    device = torch.device(text)
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise DemoError(f"{option} {text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= n:
            raise DemoError(f"{option} {text}: this machine has {n} CUDA device(s)")
    return device


def make_out_dir(option: str, path: str) -> None:
    """Makes the output folder ``path`` (if it is not one already) and checks that a file can be
    written there; DemoError otherwise. Called last among the checks, so that a bad option
    elsewhere leaves nothing behind."""
    if not path:
        raise DemoError(f"{option} {path!r}: expected a folder path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise DemoError(f"{option} {path!r}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise DemoError(f"{option} {path!r}: cannot write there ({e.strerror or e})") from None


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` while active."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def md_table(head: list[str], rows: list[list[str]], left: set[int]) -> str:
    """A Markdown table, the columns in ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep, *map(line, rows)])


def parse_once(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, refusing an option given twice (argparse keeps the last one
    silently) unless it is one that collects its values (``action="append"``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    seen: dict[str, str] = {}
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        for action in parser._actions:  # noqa: SLF001 - argparse's own table of the options
            if name in action.option_strings and not isinstance(
                    action, (argparse._AppendAction, argparse._CountAction,  # noqa: SLF001
                             argparse._HelpAction)):  # noqa: SLF001
                key = action.dest
                if key in seen:
                    parser.error(f"argument {name}: given more than once ({seen[key]} and "
                                 f"{token})")
                seen[key] = token
    return parser.parse_args(argv)


def check_file_path(option: str, path: str) -> None:
    """Raises DemoError unless a file can be written at ``path`` (its folder exists and is
    writable; the path is not a folder), before any work starts."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise DemoError(f"{option} {path!r}: is a folder, not a file")
    if not os.path.isdir(folder):
        raise DemoError(f"{option} {path!r}: its folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise DemoError(f"{option} {path!r}: cannot write there")


def plotting_available(prog: str) -> bool:
    """Whether matplotlib imports; if not, a warning that the results are written without their
    figure (before any work starts)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print(f"{prog}: warning: matplotlib is not installed: the results are written without "
          "the figure (pip install matplotlib)", file=sys.stderr)
    return False


def cli_main(prog: str, parser, run, argv: list[str] | None) -> int:
    """A tool's ``main``: parse ``argv`` (an option given twice is refused), run, and print a
    :class:`DemoError` as ``PROG: error: MESSAGE`` with exit status 2."""
    args = parse_once(parser, argv)
    try:
        run(args)
    except DemoError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
