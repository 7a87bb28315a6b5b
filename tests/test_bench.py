"""The benchmark harness prints its table (timings themselves are not asserted: they live in bench/)."""
import math
import re

import torch

from fusedopt import bench


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
        "small": {"fusedopt LAMB [cpp]": 15.0, "torch AdamW(fused=True)": 50.0},
    }
    lines = bench.ratios(medians, {"big": 100, "small": 10})
    assert lines == [
        "big: fusedopt LAMB [cpp] / torch AdamW(fused=True) = 1.50",
        "big: timm Lamb (foreach) / fusedopt LAMB [cpp] = 5.00",
        "big: fusedopt LAMB [eager] / fusedopt LAMB [cpp] = 8.00",
        "small: fusedopt LAMB [cpp] / torch AdamW(fused=True) = 0.30",
        "fusedopt LAMB [cpp]: time per element, small / big = 1.25",
    ]
