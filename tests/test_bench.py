"""The benchmark harness prints its table (timings themselves are not asserted: they live in bench/)."""
import math
import re
from pathlib import Path

import pytest
import torch

import fusedopt
from fusedopt.tools import bench

ROOT = Path(__file__).resolve().parents[1]


def test_quick_bench_prints_the_table(capsys):
    bench.run(quick=True, repeats=3, only="LARS [eager]")
    out = capsys.readouterr().out
    assert re.search(r"in-place bandwidth \d+\.\d GB/s", out)
    assert out.count("optimizer                                  ms/step     IQR    GB/s  of bw") == 2
    rows = re.findall(r"^fusedopt LARS \[eager\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)%$", out, re.M)
    assert len(rows) == 2 and all(float(r[0]) > 0 for r in rows)


def test_bytes_model_matches_spec():
    assert bench.BYTES_PER_ELEMENT == {"lamb": 40, "lars": 28, "adamw": 28, "sgd": 20}
    shapes = bench.bert_base_shapes()
    numel = sum(math.prod(s) for s in shapes)
    assert 190 <= len(shapes) <= 210 and 105e6 < numel < 115e6  # BERT-base: ~110M in ~200 tensors


def test_interleave_runs_every_candidate_once_per_round():
    calls = []
    times = bench.interleave({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                             torch.device("cpu"), rounds=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then rounds in turn
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}


def test_ratios_of_the_performance_targets():
    medians = {
        "big": {"fusedopt LAMB [cpp]": 120.0, "torch AdamW(fused=True)": 80.0,
                "timm Lamb (foreach)": 600.0, "fusedopt LAMB [eager]": 960.0},
        "small": {"fusedopt LAMB [cpp]": 15.0, "torch AdamW(fused=True)": 50.0,
                  "fusedopt LAMB [cpp] (flattened params)": 12.0},
    }
    assert bench.ratios(medians) == [
        "big: fusedopt LAMB [cpp] / torch AdamW(fused=True) = 1.50",
        "big: timm Lamb (foreach) / fusedopt LAMB [cpp] = 5.00",
        "big: fusedopt LAMB [eager] / fusedopt LAMB [cpp] = 8.00",
        "small: fusedopt LAMB [cpp] / torch AdamW(fused=True) = 0.30",
    ]
    assert bench.per_element_ratios(medians, {"big": 100, "small": 10}) == [
        "fusedopt LAMB [cpp]: time per element, small / big = 1.25",
        "torch AdamW(fused=True): time per element, small / big = 6.25",
        # a flattened row is compared with the same optimizer on the (unflattened) big set
        "fusedopt LAMB [cpp] (flattened params): time per element, small / big = 1.00",
    ]


def test_joint_rounds_time_both_sets_in_the_same_rounds(monkeypatch):
    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock) * 1e-3)  # 1 ms a read

    def fn(name, reads):
        def run():
            calls.append(name)
            for _ in range(reads):  # each read of the clock inside a call adds 1 ms to it
                bench.time.perf_counter()
        return run

    fns = {"big": {"row": fn("big row", 9), "yard": fn("big yard", 0)},
           "small": {"row": fn("small row", 1), "yard": fn("small yard", 0)}}
    lines = bench.joint_rounds(fns, {"big": 100, "small": 10}, torch.device("cpu"), rounds=2)
    assert calls[8:] == ["big row", "big yard", "small row", "small yard"] * 2  # after warm-up
    # row: 10 ms per 100 elements against 2 ms per 10; yard: 1 ms each
    assert lines == ["time per element, both sets in the same 2 rounds:",
                     "row: time per element, small / big = 2.00",
                     "yard: time per element, small / big = 10.00"]


@pytest.mark.skipif("cpp" not in fusedopt.available_backends(),
                    reason="needs the C++ extension fusedopt._C (not built)")
def test_quick_bench_prints_the_joint_per_element_ratios(capsys):
    bench.run(quick=True, repeats=3, only="LAMB [cpp]")
    out = capsys.readouterr().out
    assert "time per element, both sets in the same 3 rounds:" in out
    for row in ("fusedopt LAMB [cpp]", "fusedopt LAMB [cpp] (flattened params)",
                "in-place a.add_(c, alpha=s)"):
        assert re.search(rf"^{re.escape(row)}: time per element, 500 x 2,500 / "
                         r"bert-like \(2 layers\) = \d+\.\d\d$", out, re.M), out
    # the flattened rows are timed in the small set's table, not in the bert-like one
    tables = out.split("\n\n")
    assert "(flattened params)" in tables[2] and "(flattened params)" not in tables[1], out


def test_sweep_formats_compares_the_formats_seed_by_seed(tmp_path, capsys, monkeypatch):
    """bench/sweep_formats.py: reached counts, the median and quartiles with the seeds that did
    not reach the target ranked slowest, and the tests against the first sweep."""
    import json
    import runpy
    import sys

    def sweep(name, steps):
        runs = [{"status": "reached" if s else "not reached", "steps": s or 85} for s in steps]
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(
            json.dumps({"results": {"lamb": {"1024": {"runs": runs}}}}))
        return str(tmp_path / name)

    folders = [sweep("a", [10, 20, 30, 40]), sweep("b", [10, 20, 30, None]),
               sweep("c", [None, None, None, None])]
    monkeypatch.setattr(sys, "argv", ["sweep_formats.py", *folders])
    runpy.run_path(str(ROOT / "bench" / "sweep_formats.py"), run_name="__main__")
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [[c.strip() for c in r[2:5]] for r in rows] == [
        ["a", "4/4", "25 [17.5-32.5]"], ["b", "3/4", "25 [17.5->cap]"],
        ["c", "0/4", ">cap [>cap->cap]"]]
    assert rows[0][5].strip() == "" and rows[2][5].strip().startswith("0.03, ")  # Fisher: 2/70
