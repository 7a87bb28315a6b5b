"""The large-batch demo (python -m fusedopt demo) on a tiny epoch budget, and the CLI."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from fusedopt.tools import demo  # noqa: E402
from fusedopt.__main__ import main as cli_main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(["demo", "--epochs", "3", "--out", str(out), "--no-progress", "--seed", "0",
                       "--probe-windows", "6"])
    return rc, buf.getvalue(), out


def test_demo_prints_table_and_writes_outputs(demo_run):
    rc, stdout, out = demo_run
    assert rc == 0
    labels = [r["label"] for r in demo.RECIPES.values()]
    table_lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert len(table_lines) == 2 + len(labels)  # header, separator, one row per run
    for label in labels:
        assert sum(label in ln for ln in table_lines) == 1, label
    png = out / "accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # a real figure, not an empty canvas
    assert (out / "table.md").read_text().startswith(table_lines[0])


def test_demo_results_are_sane(demo_run):
    _, _, out = demo_run
    res = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in res["results"]}
    assert set(runs) == set(demo.RECIPES)
    n_train = 1797 - 360  # load_digits minus the 20% stratified test split
    for r in runs.values():
        assert len(r["accuracy_per_epoch"]) == 3
        assert all(0.0 <= a <= 1.0 for a in r["accuracy_per_epoch"])
        assert r["steps"] == 3 * math.ceil(n_train / r["batch_size"])
        assert r["train_time_s"] > 0
        assert not r["diverged"]
        # The probes (GradientAccumulationNoiseScale, 6 windows of 16 x 32 examples) agree with
        # the exact noise scale from all per-example gradients. Early in training the standard
        # error of 6 windows is ~5-10% (its value is recorded): allow 5 standard errors.
        for when in ("early", "late"):
            est, se = r[f"noise_scale_{when}"], r[f"noise_scale_{when}_se"]
            exact = r[f"exact_noise_scale_{when}"]
            assert math.isfinite(est) and est > 0 and exact > 0, (r["name"], when)
            if when == "early":
                assert se < 0.25 * exact, (r["name"], se, exact)
                assert abs(est - exact) < 5 * se, (r["name"], est, se, exact)
    # 3 epochs of small-batch SGD (~135 steps) learns digits far above chance (0.1)
    assert runs["sgd_b32"]["final_accuracy"] > 0.85
    # the large-batch runs made 16x fewer steps; they still learn something
    for name in ("sgd_b512", "sgd_b512_scaled", "lars_b512", "lamb_b512"):
        assert runs[name]["steps"] * 16 <= runs["sgd_b32"]["steps"] + 16
        assert max(runs[name]["accuracy_per_epoch"]) > 0.2, name
    # the scaling rule is applied to the baseline LR, not typed in separately
    assert runs["sgd_b512_scaled"]["peak_lr"] == pytest.approx(16 * runs["sgd_b32"]["peak_lr"])
    assert runs["sgd_b512"]["peak_lr"] == runs["sgd_b32"]["peak_lr"]


def test_demo_same_initialization_and_data_order(tmp_path):
    # runs are comparable: same seed -> identical result for the same recipe
    import argparse

    args = demo.build_parser().parse_args(
        ["--epochs", "1", "--runs", "sgd_b512", "--no-progress", "--no-noise-scale",
         "--out", str(tmp_path)])
    a = demo.run(args)[0]
    b = demo.run(args)[0]
    assert a["accuracy_per_epoch"] == b["accuracy_per_epoch"]
    assert isinstance(args, argparse.Namespace)


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "--epochs 0"),
    (["--runs", "adam_b512"], "adam_b512"),
    (["--set", "lars_b512.lr"], "RUN.KEY=VALUE"),
    (["--set", "nope.lr=1"], "unknown run 'nope'"),
    (["--dataset", "/nonexistent/folder"], "not a directory"),
])
def test_demo_bad_options_fail_clearly(argv, message, capsys, tmp_path):
    rc = demo.main(argv + ["--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_demo_dataset_without_torchvision(tmp_path, capsys):
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed")
    (tmp_path / "cats").mkdir()
    rc = demo.main(["--dataset", str(tmp_path), "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    assert "torchvision" in capsys.readouterr().err


def test_demo_cuda_unavailable(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    rc = demo.main(["--device", "cuda", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_cli_module_entry_point():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "fusedopt", "demo", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for opt in ("--epochs", "--seed", "--out", "--device", "--dataset", "--no-progress"):
        assert opt in r.stdout


def test_cli_dispatch(monkeypatch, capsys):
    import fusedopt.tools.bench as bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv=None: seen.append(argv))
    assert cli_main(["bench", "--quick", "-x"]) == 0
    assert seen == [["--quick", "-x"]]
    assert cli_main([]) == 2
    err = capsys.readouterr().err
    assert "usage" in err and "fusedopt: error: a command is required" in err
    assert cli_main(["--help"]) == 0
    assert cli_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_demo_image_folder_glue_with_stub_torchvision(tmp_path, monkeypatch, capsys):
    # torchvision is optional; a stub with the same API checks the --dataset path of the demo
    # (loading, flattening, stratified split, training) without it.
    import types

    import torch

    root = tmp_path / "data"
    for c in ("ant", "bee", "cat"):
        (root / c).mkdir(parents=True)

    class ImageFolder:
        def __init__(self, path, transform=None):
            self.classes = sorted(os.listdir(path))
            g = torch.Generator().manual_seed(0)
            # class c: pixels uniform in [0.3c, 0.3c + 0.5]; well separated classes
            self.items = [(torch.rand(1, 16, 16, generator=g) * 0.5 + 0.3 * c, c)
                          for c in range(len(self.classes)) for _ in range(40)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    tv = types.ModuleType("torchvision")
    tv.datasets = types.SimpleNamespace(ImageFolder=ImageFolder)
    tv.transforms = types.SimpleNamespace(
        Compose=lambda ts: ts, Resize=lambda size: size, ToTensor=lambda: None,
        Grayscale=lambda num_output_channels: num_output_channels)
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    out = tmp_path / "out"
    rc = demo.main(["--dataset", str(root), "--epochs", "8", "--runs", "sgd_b32,lars_b512",
                    "--no-noise-scale", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert "ImageFolder" in res["data"] and "3 classes" in res["data"]
    small = res["results"][0]
    assert small["steps"] == 8 * math.ceil(96 / 32)  # 120 images, 24 held out for test
    # the stub classes are separable: the loaded data is learnable (labels kept with images)
    assert max(r["final_accuracy"] for r in res["results"]) > 0.9
