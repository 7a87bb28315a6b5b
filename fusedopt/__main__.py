"""Command line: ``python -m fusedopt {check,demo,bench} [options]`` (also the ``fusedopt`` script).

``check`` runs :mod:`fusedopt.check` (every backend on every device against the float64
reference, then a short speed table); ``demo`` runs :mod:`fusedopt.demo` (small vs large batch on
scikit-learn's digits); ``bench`` forwards its arguments to :func:`fusedopt.bench.main`.
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
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        from . import check

        return check.main(rest)
    if cmd == "demo":
        from . import demo

        return demo.main(rest)
    if cmd == "bench":
        from . import bench

        rc = bench.main(rest)
        return 0 if rc is None else int(rc)
    print(f"fusedopt: error: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
