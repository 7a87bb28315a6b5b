"""Bad command lines are refused before any work starts: every option and every ``--set`` value of
``fusedopt demo`` and ``fusedopt demo sweep``, and the options of ``check`` and ``bench``.

One table of (argv, what the error line must say), run through the real entry point
(``fusedopt.__main__.main``): exit status 2, an ``error:`` line naming the option or key and the
value, no traceback. Training, the benchmark and the self-check are replaced by a function that
fails the test, so a bad value that slipped through validation shows up as a failure here rather
than as a long run.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fusedopt.__main__ import main as cli_main
from fusedopt.tools import bench, check, demo
from fusedopt.tools.common import check_table
from fusedopt.tools.sweep import cli as sweep_cli
from fusedopt.tools.sweep import config as sweep_config
from fusedopt.tools.sweep import training as sweep_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = "{file}"  # replaced by the path of an existing plain file

# A bad value of every key of the demo's recipes and the sweep's optimizer table (the generated
# part of the table below: every key of every entry, so a key added later needs an entry here).
DEMO_BAD = {
    "label": ("", "label ''"),
    "optimizer": ("lamb", "cannot be set"),
    "batch": ("0", "batch '0'"),
    "lr": ("-1", "lr '-1'"),
    "momentum": ("2", "momentum '2'"),
    "weight_decay": ("-1", "weight_decay '-1'"),
    "trust_coefficient": ("0", "trust_coefficient '0'"),
    "betas": ("(0.9,)", "betas '(0.9,)'"),
    "eps": ("0", "eps '0'"),
    "warmup_epochs": ("nan", "warmup_epochs 'nan'"),
    "warmup_start_factor": ("1.5", "warmup_start_factor '1.5'"),
    "decay": ("linear", "decay 'linear'"),
    "power": ("0", "power '0'"),
    "state_precision": ("fp8", "state_precision 'fp8'"),
}
SWEEP_BAD = {
    "label": ("x", "cannot be set"),
    "optimizer": ("lamb", "cannot be set"),
    "rule": ("cubic", "rule 'cubic'"),
    "base_lr": ("nan", "base_lr 'nan'"),
    "momentum": ("1", "momentum '1'"),
    "weight_decay": ("inf", "weight_decay 'inf'"),
    "trust_coefficient": ("-0.001", "trust_coefficient '-0.001'"),
    "betas": ("(0.9, 1.0)", "betas '(0.9, 1.0)'"),
    "eps": ("-1e-6", "eps '-1e-6'"),
    "state_precision": ("int4", "state_precision 'int4'"),
}


def _every_key() -> list[tuple[list[str], str]]:
    out = []
    for name, recipe in demo.RECIPES.items():
        for key in [*recipe, *(k for k in demo.SCHEDULE_KEYS if k not in recipe)]:
            value, msg = DEMO_BAD[key]
            out.append((["demo", "--set", f"{name}.{key}={value}"], msg))
    for name, spec in sweep_config.OPTIMIZERS.items():
        for key in spec:
            value, msg = SWEEP_BAD[key]
            out.append((["demo", "sweep", "--set", f"{name}.{key}={value}"], msg))
    return out


BAD: list[tuple[list[str], str]] = [
    # ---------------------------------------------------------------- demo: --set
    (["demo", "--set", "lars_b512.bogus=1"], "lars_b512 has no setting 'bogus'"),
    (["demo", "--set", "sgd_b512.trust_coefficient=0.001"], "no setting 'trust_coefficient'"),
    (["demo", "--set", "nope.lr=1"], "unknown run 'nope'"),
    (["demo", "--set", "lars_b512.lr"], "RUN.KEY=VALUE"),
    (["demo", "--set", "lars_b512lr=2"], "RUN.KEY=VALUE"),
    (["demo", "--set", "sgd_b32.lr=abc"], "lr 'abc'"),
    (["demo", "--set", "sgd_b32.lr=-1"], "lr '-1'"),
    (["demo", "--set", "sgd_b32.lr=0"], "lr '0'"),
    (["demo", "--set", "sgd_b32.lr=inf"], "lr 'inf'"),
    (["demo", "--set", "sgd_b32.lr=nan"], "lr 'nan'"),
    (["demo", "--set", "sgd_b32.lr=1e999"], "lr '1e999'"),
    (["demo", "--set", "sgd_b32.lr=1e39"], "lr '1e39'"),  # beyond float32, the MLP's dtype
    (["demo", "--set", "sgd_b32.lr=" + "9" * 400], "lr '999"),  # an int too large for a float
    (["demo", "--set", "sgd_b32.lr=True"], "lr 'True'"),
    (["demo", "--set", "sgd_b32.lr=None"], "lr 'None'"),
    (["demo", "--set", "sgd_b32.lr=(1,2)"], "lr '(1,2)'"),
    (["demo", "--set", "sgd_b32.lr="], "lr ''"),
    (["demo", "--set", "sgd_b32.lr=" + "(" * 300], "lr '((("),
    (["demo", "--set", "lars_b512.lr==lars_b512"], "cycle of LR references: lars_b512 -> lars_b512"),
    (["demo", "--set", "sgd_b32.lr==sgd_b512"], "sgd_b32 -> sgd_b512 -> sgd_b32"),
    (["demo", "--set", "sgd_b32.lr==lamb_b512", "--set", "lamb_b512.lr==sgd_b512_scaled*2"],
     "sgd_b32 -> lamb_b512 -> sgd_b512_scaled -> sgd_b32"),
    (["demo", "--set", "sgd_b32.lr==nope"], "refers to unknown recipe 'nope'"),
    (["demo", "--set", "sgd_b32.lr=="], "lr '='"),
    (["demo", "--set", "sgd_b512.lr==sgd_b32*abc"], "lr '=sgd_b32*abc'"),
    (["demo", "--set", "sgd_b512.lr==sgd_b32*-2"], "lr '=sgd_b32*-2'"),
    (["demo", "--set", "sgd_b512.lr==sgd_b32*nan"], "lr '=sgd_b32*nan'"),
    (["demo", "--set", "sgd_b32.lr=10", "--set", "sgd_b512.lr==sgd_b32*1e308"],
     "lr '=sgd_b32*1e308' is inf"),
    (["demo", "--set", "sgd_b32.batch=-3"], "batch '-3'"),
    (["demo", "--set", "sgd_b32.batch=1.5"], "batch '1.5'"),
    (["demo", "--set", "sgd_b32.batch=medium"], "batch 'medium'"),
    (["demo", "--set", "sgd_b32.optimizer=adam"], "sgd_b32.optimizer cannot be set"),
    (["demo", "--set", "sgd_b32.momentum=True"], "momentum 'True'"),  # a bool is not a number
    (["demo", "--set", "sgd_b32.momentum=-0.1"], "momentum '-0.1'"),
    (["demo", "--set", "sgd_b32.momentum='abc'"], "momentum \"'abc'\""),
    (["demo", "--set", "lamb_b512.betas=0.9"], "betas '0.9'"),
    (["demo", "--set", "lamb_b512.betas=(0.9,0.999,0.9)"], "betas '(0.9,0.999,0.9)'"),
    (["demo", "--set", "lamb_b512.betas=(1.5,0.999)"], "betas '(1.5,0.999)'"),
    (["demo", "--set", "lamb_b512.betas=(0.9,'x')"], "betas \"(0.9,'x')\""),
    (["demo", "--set", "lamb_b512.eps=1e-45"], "eps '1e-45'"),  # below float32's normals
    (["demo", "--set", "sgd_b32.warmup_epochs=-1"], "warmup_epochs '-1'"),
    (["demo", "--set", "sgd_b32.warmup_epochs=inf"], "warmup_epochs 'inf'"),
    (["demo", "--set", "sgd_b32.warmup_epochs=1e308"], "warmup_epochs '1e308'"),
    (["demo", "--set", "sgd_b32.warmup_start_factor=-0.5"], "warmup_start_factor '-0.5'"),
    (["demo", "--set", "sgd_b32.decay=0"], "decay '0'"),
    (["demo", "--set", "sgd_b32.power=-1"], "power '-1'"),
    (["demo", "--set", "lars_b512.trust_coefficient=nan"], "trust_coefficient 'nan'"),
    # ---------------------------------------------------------------- demo: options
    (["demo", "--epochs", "0"], "--epochs 0"),
    (["demo", "--epochs", "-3"], "--epochs -3"),
    (["demo", "--epochs", "abc"], "argument --epochs: invalid int value: 'abc'"),
    (["demo", "--seed", "-1"], "--seed -1"),
    (["demo", "--seed", str(2 ** 64)], f"--seed {2 ** 64}"),
    (["demo", "--seed", "9" * 400], "--seed 999"),  # an int too large for a float
    (["demo", "--threads", "0"], "--threads 0"),
    (["demo", "--threads", "100000"], "--threads 100000"),
    (["demo", "--probe-windows", "1"], "--probe-windows 1"),
    (["demo", "--probe-windows", str(10 ** 12)], f"--probe-windows {10 ** 12}"),
    (["demo", "--image-size", "0"], "--image-size 0"),
    (["demo", "--device", "tpu"], "--device 'tpu'"),
    (["demo", "--device", "cuda:99"], "--device cuda:99"),
    (["demo", "--runs", "adam_b512"], "adam_b512"),
    (["demo", "--runs", ","], "--runs"),
    (["demo", "--eval-on", "train"], "argument --eval-on: invalid choice: 'train'"),
    (["demo", "--dataset", "/nonexistent/folder"], "--dataset '/nonexistent/folder'"),
    (["demo", "--out", FILE], "exists and is not a folder"),
    (["demo", "--out", os.path.join(FILE, "sub")], "cannot write there"),
    (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    # ---------------------------------------------------------------- sweep: options
    (["demo", "sweep", "--warmup-epochs", "nan"], "--warmup-epochs nan"),
    (["demo", "sweep", "--warmup-epochs", "inf"], "--warmup-epochs inf"),
    (["demo", "sweep", "--warmup-epochs", "-1"], "--warmup-epochs -1"),
    (["demo", "sweep", "--max-epochs", "nan"], "--max-epochs nan"),
    (["demo", "sweep", "--max-epochs", "inf"], "--max-epochs inf"),
    (["demo", "sweep", "--max-epochs", "0"], "--max-epochs 0"),
    (["demo", "sweep", "--max-epochs", "1e308"], "--max-epochs 1e+308"),
    (["demo", "sweep", "--target-loss", "nan"], "--target-loss nan"),
    (["demo", "sweep", "--target-loss", "0"], "never reached"),
    (["demo", "sweep", "--target-loss=-inf"], "--target-loss -inf"),
    (["demo", "sweep", "--target-accuracy", "nan"], "--target-accuracy nan"),
    (["demo", "sweep", "--target-accuracy", "1.5"], "never reached"),
    (["demo", "sweep", "--eval-ratio", "0"], "--eval-ratio 0"),
    (["demo", "sweep", "--eval-ratio", "nan"], "--eval-ratio nan"),
    (["demo", "sweep", "--eval-ratio", "2"], "--eval-ratio 2"),
    (["demo", "sweep", "--probe-windows", "1"], "--probe-windows 1"),
    (["demo", "sweep", "--bootstrap", "-1"], "--bootstrap -1"),
    (["demo", "sweep", "--bootstrap", str(10 ** 9)], f"--bootstrap {10 ** 9}"),
    (["demo", "sweep", "--threads", "0"], "--threads 0"),
    (["demo", "sweep", "--seeds", "-1"], "--seeds -1"),
    (["demo", "sweep", "--seeds", "a,b"], "--seeds 'a,b'"),
    (["demo", "sweep", "--seeds", ""], "--seeds '': empty"),
    (["demo", "sweep", "--tune-seeds", str(2 ** 40)], f"--tune-seeds {2 ** 40}"),
    (["demo", "sweep", "--lr-grid", "1,-2"], "multipliers must be finite and > 0"),
    (["demo", "sweep", "--lr-grid", "nan"], "multipliers must be finite and > 0"),
    (["demo", "sweep", "--lr-grid", "abc"], "--lr-grid 'abc'"),
    (["demo", "sweep", "--tuning", "best"], "--tuning 'best'"),
    (["demo", "sweep", "--tuning", ""], "--tuning ''"),
    (["demo", "sweep", "--lr-cap", "0"], "--lr-cap 0"),
    (["demo", "sweep", "--lr-cap", "21"], "--lr-cap 21"),
    (["demo", "sweep", "--lr-cap", "2.5"], "argument --lr-cap: invalid int value"),
    (["demo", "sweep", "--batches", ","], "empty"),
    (["demo", "sweep", "--batches", "16,abc"], "'abc' is not an integer"),
    (["demo", "sweep", "--batches", "1.5"], "'1.5' is not an integer"),
    (["demo", "sweep", "--batches", "0,16"], "must be >= 1"),
    (["demo", "sweep", "--batches", "4096"], "larger than the tuning split"),
    (["demo", "sweep", "--optimizers", "adam"], "unknown ['adam']"),
    (["demo", "sweep", "--out", FILE], "exists and is not a folder"),
    (["demo", "sweep", "--max-epochs", "abc"], "argument --max-epochs: invalid float value"),
    # ---------------------------------------------------------------- sweep: --set
    (["demo", "sweep", "--set", "lars.nope=1"], "has no setting 'nope'"),
    (["demo", "sweep", "--set", "adam.base_lr=1"], "unknown optimizer 'adam'"),
    (["demo", "sweep", "--set", "lars.base_lr=-1"], "base_lr '-1'"),
    (["demo", "sweep", "--set", "lars.base_lr=inf"], "base_lr 'inf'"),
    (["demo", "sweep", "--set", "lars.base_lr=abc"], "base_lr 'abc'"),
    (["demo", "sweep", "--set", "sgd.momentum=2"], "momentum '2'"),
    (["demo", "sweep", "--set", "lamb.betas=(0.9,)"], "betas '(0.9,)'"),
    (["demo", "sweep", "--set", "lamb.eps=0"], "eps '0'"),
    # finite settings whose product overflows: found once the batch sizes are known, before
    # the tuning starts
    (["demo", "sweep", "--set", "lamb.base_lr=1e38", "--batches", "16,full"],
     "the LR of lamb at batch"),
    (["demo", "sweep", "--optimizers", "lars", "--set", "lars.base_lr=1e30", "--lr-grid", "1e300",
      "--batches", "16"], "the LR of lars at batch 16"),
    # the wide search's cap reaches an LR that overflows: refused before the tuning starts
    (["demo", "sweep", "--optimizers", "lars", "--set", "lars.base_lr=1e36", "--lr-cap", "10",
      "--batches", "16"], "--lr-cap: the LR of lars at batch 16"),
    # ---------------------------------------------------------------- check, bench, top level
    (["check", "--device", "tpu"], "--device 'tpu'"),
    (["check", "--device", "cuda:99"], "--device cuda:99"),
    (["check", "--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    (["check", "--quick=1"], "--quick"),
    (["bench", "--repeats", "0"], "--repeats 0"),
    (["bench", "--repeats", "1"], "--repeats 1"),
    (["bench", "--repeats", "-3"], "--repeats -3"),
    (["bench", "--repeats", "nan"], "argument --repeats: invalid int value: 'nan'"),
    (["bench", "--device", "tpu"], "--device 'tpu'"),
    (["bench", "--device", "cuda:99"], "--device cuda:99"),
    (["bench", "--only", "adagrad"], "--only 'adagrad': matches none"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    ([], "a command is required"),
    (["check", "--json", os.path.join(FILE, "report.json")], "--json"),
    (["check", "--json", "/nonexistent/folder/report.json"], "does not exist"),
    (["check", "--quick", "--quick"], "argument --quick: given more than once"),
    (["bench", "--repeats", "3", "--repeats", "4"], "argument --repeats: given more than once"),
    (["demo", "--runs", "sgd_b32", "--runs", "lars_b512"], "argument --runs: given more than once"),
    (["demo", "--epochs=2", "--epochs", "3"], "argument --epochs: given more than once"),
    (["demo", "sweep", "--batches", "16", "--batches", "32"],
     "argument --batches: given more than once"),
    (["demo", "sweep", "--seeds", "1", "--seeds=2"], "argument --seeds: given more than once"),
    *_every_key(),
]


# Checked once the data is loaded (before the tuning starts): the sweep needs scikit-learn.
NEEDS_DATA = {"larger than the tuning split", "the LR of lamb at batch", "the LR of lars at batch 16",
              "--lr-cap: the LR of lars at batch 16"}


def _run(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as e:  # argparse's errors
        return e.code


@pytest.fixture
def no_work(monkeypatch):
    """Training, the benchmark and the self-check fail the test if they start."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    for module, name in [(demo, "run_recipe"), (demo, "probe_noise_scale"),
                         (demo, "load_data"), (sweep_training, "tune"),
                         (sweep_training, "measure"), (bench, "run"), (check, "run")]:
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a)[:80] or "(none)" for a, _ in BAD])
def test_bad_command_line_is_an_error_line(argv, message, no_work, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    argv = [a.replace(FILE, str(a_file)) for a in argv]
    if argv[:1] == ["demo"] and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    if message in NEEDS_DATA:
        pytest.importorskip("sklearn")
    code = _run(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err
    assert message in errors[0], errors[0]


def test_the_table_covers_every_setting():
    keys = {k for r in demo.RECIPES.values() for k in r} | set(demo.SCHEDULE_KEYS)
    assert keys == set(DEMO_BAD) == set(demo.RECIPE_SETTINGS)
    keys = {k for s in sweep_config.OPTIMIZERS.values() for k in s}
    assert keys == set(SWEEP_BAD) == set(sweep_config.SPEC_SETTINGS)


def test_the_tools_own_tables_pass_their_checks():
    check_table(demo.RECIPES, demo.RECIPE_SETTINGS, "recipe")
    check_table(sweep_config.OPTIMIZERS, sweep_config.SPEC_SETTINGS, "optimizer")
    for name in demo.RECIPES:
        assert demo.resolve_lr(demo.RECIPES, name) > 0


def test_good_set_values_are_taken(tmp_path):
    args = demo.build_parser().parse_args(
        ["--set", "sgd_b32.lr=0.05", "--set", "sgd_b32.label=2",
         "--set", "sgd_b32.warmup_start_factor=0.5", "--set", "sgd_b32.decay=cosine",
         "--set", "lamb_b512.betas=[0.8, 0.99]", "--set", "lars_b512.lr==sgd_b32*100",
         "--set", "sgd_b512.batch=small", "--out", str(tmp_path)])
    plan = demo.validate(args)
    r = plan["recipes"]
    assert r["sgd_b32"]["label"] == "2"  # a text setting is taken as written
    assert r["sgd_b32"]["warmup_start_factor"] == 0.5 and r["sgd_b32"]["decay"] == "cosine"
    assert r["lamb_b512"]["betas"] == (0.8, 0.99)
    assert demo.resolve_lr(r, "sgd_b512_scaled") == pytest.approx(0.8)
    assert demo.resolve_lr(r, "lars_b512") == pytest.approx(5.0)
    assert demo.RECIPES["sgd_b32"]["lr"] == 0.02  # the module's table is not touched
    args = sweep_cli.build_parser().parse_args(
        ["--set", "lars.rule=sqrt", "--set", "lamb.betas=(0.9, 0.99)", "--set", "sgd.base_lr=1",
         "--seeds", "3,3,4", "--out", str(tmp_path)])
    cfg = sweep_cli.validate(args)
    assert cfg["specs"]["lars"]["rule"] == "sqrt" and cfg["specs"]["lamb"]["betas"] == (0.9, 0.99)
    assert cfg["specs"]["sgd"]["base_lr"] == 1 and cfg["seeds"] == (3, 4)


@pytest.mark.parametrize("argv, message", [
    (["-m", "fusedopt", "demo", "--set", "lars_b512.bogus=1"], "no setting 'bogus'"),
    (["-m", "fusedopt", "demo", "--set", "lars_b512.lr==lars_b512"], "cycle of LR references"),
    (["-m", "fusedopt", "demo", "sweep", "--warmup-epochs", "nan"], "--warmup-epochs nan"),
    (["-m", "fusedopt", "demo", "sweep", "--max-epochs", "nan"], "--max-epochs nan"),
    (["-m", "fusedopt.tools.bench", "--repeats", "0"], "--repeats 0"),
])
def test_bad_command_line_in_a_subprocess(argv, message, tmp_path):
    # the real `python -m` entry points, without the guard above: a run that started would time
    # out here
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, *argv, *(["--out", str(tmp_path)] if "demo" in argv
                                                 else [])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "error:" in r.stderr and message in r.stderr, r.stderr


@pytest.mark.parametrize("argv, files", [
    (["demo", "--epochs", "1", "--runs", "sgd_b32", "--no-noise-scale", "--no-progress"],
     ("table.md", "results.json")),
    (["demo", "sweep", "--batches", "16,full", "--optimizers", "sgd", "--seeds", "0",
      "--tune-seeds", "100", "--lr-grid", "1", "--lr-cap", "1", "--target-loss", "2",
      "--target-accuracy", "0.1", "--max-epochs", "1", "--no-noise-scale", "--bootstrap", "10",
      "--no-progress"], ("sweep.md", "sweep.json")),
], ids=["demo", "sweep"])
def test_without_matplotlib_the_results_are_written(argv, files, tmp_path, capsys, monkeypatch):
    """Without matplotlib the tools warn before any work, write their results and leave the
    figure out (they trained fully, then failed in the plot before anything was saved)."""
    pytest.importorskip("sklearn")
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find(name, *a))
    code = _run([*argv, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert "warning: matplotlib is not installed" in err and "error:" not in err
    assert all((tmp_path / f).stat().st_size > 0 for f in files)
    assert not list(tmp_path.glob("*.png"))
