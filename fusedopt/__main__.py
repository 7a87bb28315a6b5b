"""Command line: ``python -m fusedopt {check,demo,bench} [options]`` (also the ``fusedopt`` script).

``check`` runs :mod:`fusedopt.tools.check` (every backend on every device against the float64
reference, then a short speed table); ``demo`` runs :mod:`fusedopt.tools.demo` (small vs large
batch on scikit-learn's digits) and ``demo sweep`` :mod:`fusedopt.tools.sweep` (the batch-size
sweep); ``bench`` forwards its arguments to :func:`fusedopt.tools.bench.main`.

Bad options are refused before any work starts: an ``error:`` line on stderr, exit status 2.
"""
from __future__ import annotations

import sys

USAGE = """usage: fusedopt {check,demo,bench} [options]

commands:
  check   self-check: every backend on every device against the float64 reference, then a
          short speed table; exits non-zero on any failure (fusedopt check --help)
  demo    small-batch vs large-batch training (SGD, linear scaling + warm-up, LARS, LAMB) on
          scikit-learn's digits: prints a table, writes a plot (fusedopt demo --help);
          `demo sweep`: the batch-size sweep, steps vs examples to a target per optimizer,
          the fitted critical batch size beside the gradient noise scale
  bench   optimizer step-time benchmark (fusedopt bench --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(f"{USAGE}\nfusedopt: error: a command is required", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        from .tools import check

        return check.main(rest)
    if cmd == "demo":
        if rest[:1] == ["sweep"]:
            from .tools.sweep import cli as sweep_cli

            return sweep_cli.main(rest[1:])
        from .tools import demo

        return demo.main(rest)
    if cmd == "bench":
        from .tools import bench

        rc = bench.main(rest)
        return 0 if rc is None else int(rc)
    print(f"fusedopt: error: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
