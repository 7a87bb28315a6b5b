"""The benchmark harness prints its table (timings themselves are not asserted: they live in bench/)."""
import math
import re

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
