"""The batch-size sweep (python -m fusedopt demo sweep): the hyperbola fit, a tiny end-to-end
sweep, and its error messages."""
from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusedopt.tools.sweep import cli, config, fit, report, tuner  # noqa: E402
from fusedopt.__main__ import main as cli_main  # noqa: E402

BATCHES = np.array([16, 32, 64, 128, 256, 512, 1024, 2048], dtype=float)


def _cells(table_text):
    """The rows of the markdown tables in ``table_text`` as lists of stripped cells."""
    return [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in table_text.splitlines() if ln.startswith("| ")]


def _points(s_min, b_crit, batches=BATCHES, noise=0.0, seed=0):
    """(S, E) on (S/S_min - 1)(E/E_min - 1) = 1 with E_min = b_crit * S_min; a relative error of
    sd ``noise`` on each step count (E = B*S moves with it, as in a measurement)."""
    s = s_min * (1 + b_crit / batches)
    if noise:
        s = s * np.exp(np.random.default_rng(seed).normal(0.0, noise, len(s)))
    return s, s * batches


# ------------------------------------------------------------------------------------ the fit
@settings(max_examples=60, deadline=None)
@given(s_min=st.floats(1.0, 1e4), b_crit=st.floats(4.0, 1e5),
       n=st.integers(2, 8), start=st.integers(0, 6))
def test_fit_is_exact_on_the_hyperbola(s_min, b_crit, n, start):
    batches = 2.0 ** np.arange(start, start + n) * 8
    s, e = _points(s_min, b_crit, batches)
    got_s, got_e = fit.fit_hyperbola(s, e)
    assert got_s == pytest.approx(s_min, rel=1e-6)
    assert got_e == pytest.approx(s_min * b_crit, rel=1e-6)
    # the fitted curve passes through the points: (S/S_min - 1)(E/E_min - 1) = 1
    assert np.allclose((s / got_s - 1) * (e / got_e - 1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("s_min, b_crit", [(20.0, 150.0), (40.0, 400.0), (10.0, 1000.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_known_hyperbola_from_noisy_points(s_min, b_crit, seed):
    # 3% scatter in the step counts, the batch range spanning B_crit on both sides: S_min and
    # E_min come back within 10% (B_crit = E_min/S_min within 15%).
    s, e = _points(s_min, b_crit, noise=0.03, seed=seed)
    got_s, got_e = fit.fit_hyperbola(s, e)
    assert got_s == pytest.approx(s_min, rel=0.10)
    assert got_e == pytest.approx(s_min * b_crit, rel=0.10)
    assert got_e / got_s == pytest.approx(b_crit, rel=0.15)


def test_bootstrap_interval_covers_the_truth():
    # four "seeds" per batch size with 5% scatter; the 16-84% interval of B_crit contains the
    # true value and the point estimate is close to it
    rng = np.random.default_rng(3)
    s_min, b_crit = 30.0, 300.0
    steps = {int(b): list(s_min * (1 + b_crit / b) * np.exp(rng.normal(0, 0.05, 4)))
             for b in BATCHES}
    res = fit.bootstrap_fit(steps, 300, np.random.default_rng(0))
    assert res["b_crit"] == pytest.approx(b_crit, rel=0.15)
    assert res["b_crit_lo"] < res["b_crit"] < res["b_crit_hi"]
    assert res["b_crit_lo"] < b_crit * 1.1 and res["b_crit_hi"] > b_crit * 0.9
    assert res["boot_ok"] == 300


@pytest.mark.parametrize("s, e, message", [
    ([100.0], [1600.0], "at least 2"),
    ([100.0, 50.0], [1600.0], "step counts"),
    ([100.0, -5.0], [1600.0, 1600.0], "> 0"),
    ([100.0, math.nan], [1600.0, 3200.0], "finite"),
    # perfect scaling (E constant): no trade-off, S_min would be 0
    (list(6400.0 / BATCHES), [6400.0] * len(BATCHES), "no trade-off"),
    # steps rising with the batch: E_min/E + S_min/S = 1 has no positive solution
    ([10.0, 20.0, 40.0], [160.0, 640.0, 2560.0], "no trade-off"),
])
def test_fit_refuses_points_without_a_hyperbola(s, e, message):
    with pytest.raises(fit.FitError, match=message):
        fit.fit_hyperbola(s, e)


# ------------------------------------------------------------------------------ the tuning
def _objective(best_m, *, s0=20.0, diverge_above=None, stuck=(), calls=None):
    """A synthetic "steps to the target at multiplier m": a parabola in log2(m) around
    ``best_m`` (``s0`` steps there), "diverged" above ``diverge_above``, "not reached" at the
    multipliers in ``stuck``; it honours the search's ``best`` the way the MLP's runs do (a
    multiplier that cannot win is stopped, "slower"). ``calls`` collects the multipliers asked."""
    def evaluate(m, best):
        if calls is not None:
            calls.append(m)
        if diverge_above is not None and m > diverge_above:
            return dict(status="diverged", steps=math.inf)
        if m in stuck:
            return dict(status="not reached", steps=math.inf)
        steps = s0 * (1 + (math.log2(m) - math.log2(best_m)) ** 2)
        if steps > best:
            return dict(status="slower", steps=math.inf)
        return dict(status="reached", steps=steps)
    return evaluate


@pytest.mark.parametrize("best_m", [2.0 ** k for k in range(-5, 6)])
def test_wide_tuning_finds_the_known_best_lr_inside_the_grid(best_m):
    calls = []
    res = tuner.search_lr(_objective(best_m, calls=calls), (0.5, 1.0, 2.0), max_doublings=6)
    assert res["found"] and res["multiplier"] == best_m
    assert not res["edge"] and not res["capped"] and res["side"] is None
    tried = [c["multiplier"] for c in res["cells"]]
    # a worse neighbour on each side was tried; the cost: the grid, the way out, one step past
    assert best_m / 2 in tried and best_m * 2 in tried
    assert len(calls) == len(set(calls)) <= 3 + abs(math.log2(best_m)) + 1
    rows = _cells(report.format_tuning_table(
        {}, {"sgd": {"64": dict(batch=64, rule_lr=0.1, grid=res["cells"], **res)}}))
    assert rows[1][-1] == "interior" and rows[1][-2] == report.mult_label(best_m)[1:]


def test_wide_tuning_with_the_whole_rule_grid_diverging():
    # a large batch where the rule's LR is far off: x1/2 stuck, x1 and x2 diverge, the best LR
    # is 1/8 of the rule's; the rule-only grid finds nothing, the wide search finds it, interior
    obj = _objective(0.125, diverge_above=0.6, stuck=(0.5,))
    rule = tuner.search_lr(obj, (0.5, 1.0, 2.0), widen=False)
    assert not rule["found"] and rule["multiplier"] == 1.0
    wide = tuner.search_lr(obj, (0.5, 1.0, 2.0))
    assert wide["found"] and wide["multiplier"] == 0.125 and not wide["edge"]
    statuses = {c["multiplier"]: c["status"] for c in wide["cells"]}
    assert statuses[1.0] == "diverged" and statuses[0.5] == "not reached"
    assert statuses[0.0625] == "slower"


def test_edge_and_cap_are_reported():
    # the rule-only grid: the best (x1/8) is outside it, the choice is the grid's low edge
    res = tuner.search_lr(_objective(0.125), (0.5, 1.0, 2.0), widen=False)
    assert res["multiplier"] == 0.5 and res["edge"] and res["side"] == "low"
    assert not res["capped"]
    # the wide search, with a cap of 2^3 that the best LR (x2^10) lies beyond
    capped = tuner.search_lr(_objective(2.0 ** 10), (0.5, 1.0, 2.0), max_doublings=3)
    assert capped["multiplier"] == 8.0 and capped["edge"] and capped["side"] == "high"
    assert capped["capped"]
    assert max(c["multiplier"] for c in capped["cells"]) == 8.0
    # nothing reaches the target: down to the cap, then "none reached (cap)"
    never = tuner.search_lr(_objective(1.0, diverge_above=0.0), (0.5, 1.0, 2.0),
                            max_doublings=2)
    assert not never["found"] and never["capped"]
    assert min(c["multiplier"] for c in never["cells"]) == 0.25
    tuning = {"sgd": {str(b): dict(batch=b, rule_lr=0.1, grid=r["cells"], **r)
                      for b, r in ((16, res), (512, capped), (1024, never))}}
    rows = _cells(report.format_tuning_table({}, tuning))
    assert rows[0][-3:] == ["tuned LR", "tuned / rule", "choice"]
    assert [r[-1] for r in rows[1:]] == ["edge (low)", "edge (high), cap", "none reached (cap)"]
    assert rows[2][-3:-1] == ["0.8", "8"] and rows[3][-3:-1] == ["-", "-"]
    # columns: every multiplier tried in some row, blank where a row did not try it
    assert "x1/4" in rows[0] and rows[1][rows[0].index("x8")] == ""


def test_slower_stops_do_not_change_the_choice():
    # the same objective without the early stop: the same multiplier
    def full(best_m):
        f = _objective(best_m)
        return lambda m, best: f(m, math.inf)

    for best_m in (0.25, 1.0, 8.0):
        a = tuner.search_lr(_objective(best_m), (0.5, 1.0, 2.0))
        b = tuner.search_lr(full(best_m), (0.5, 1.0, 2.0))
        assert a["multiplier"] == b["multiplier"] == best_m


def test_ties_go_to_the_multiplier_closest_to_one():
    res = tuner.search_lr(lambda m, best: dict(status="reached", steps=10.0), (0.5, 1.0, 2.0))
    assert res["multiplier"] == 1.0 and not res["edge"]


def _probe_runs(b_noise, steps, seed_count=4):
    """Runs that reached the target in ``steps`` with one probe at init and one at the target,
    each measuring ``b_noise`` (tr = b_noise, |G|^2 = 1)."""
    return [dict(status="reached", steps=steps,
                 probes=[dict(level="init", step=0, trace=b_noise, sq_norm=1.0),
                         dict(level=0.03, step=steps, trace=b_noise, sq_norm=1.0)])
            for _ in range(seed_count)]


@pytest.mark.parametrize("b_noise, verdict", [(300.0, "contains 1"), (3000.0, "more than a factor"),
                                              (30.0, "keeps gaining")])
def test_noise_ratio_and_its_sentence(b_noise, verdict):
    # points exactly on a hyperbola with B_crit = 300 (a little seed scatter for an interval)
    rng = np.random.default_rng(1)
    cells = []
    for b in (16, 64, 256, 1024):
        runs = _probe_runs(b_noise, 30 * (1 + 300 / b))
        for r in runs:
            r["steps"] *= math.exp(rng.normal(0, 0.03))
        cells.append(dict(batch=b, runs=runs))
    q = fit.noise_ratio(cells, 1024, "0.03", 200, np.random.default_rng(0))
    assert q["step_average"] == pytest.approx(b_noise / 300, rel=0.1)
    assert q["at_target"] == pytest.approx(b_noise / 300, rel=0.1)
    assert q["step_average_lo"] <= q["step_average"] <= q["step_average_hi"]
    assert verdict in fit.noise_verdict("SGD", q)


# ------------------------------------------------------------------------------- end to end
TINY = ["demo", "sweep", "--batches", "16,128,full", "--optimizers", "sgd,lamb",
        "--seeds", "0,1", "--tune-seeds", "100", "--lr-grid", "0.5,1", "--lr-cap", "2",
        "--target-loss", "0.5", "--target-accuracy", "0.5", "--max-epochs", "3",
        "--probe-windows", "2", "--bootstrap", "20", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(TINY + ["--out", str(out)])
    return rc, buf.getvalue(), out


def test_tiny_sweep_end_to_end(tiny_run):
    rc, stdout, out = tiny_run
    assert rc == 0, stdout
    png = out / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    res = json.loads((out / "sweep.json").read_text())
    assert set(res["results"]) == {"sgd", "lamb"}
    n = res["n_train"]
    for name, per_batch in res["results"].items():
        assert [c["batch"] for c in per_batch.values()] == [16, 128, n]
        for key, cell in per_batch.items():
            # the LR is the rule's prediction times the multiplier chosen in tuning
            spec = config.OPTIMIZERS[name]
            rule = config.rule_lr(spec, cell["batch"], config.SWEEP["base_batch"])
            assert cell["lr"] == pytest.approx(rule * cell["multiplier"])
            # tuned by the wide search, within its cap of 2^±2
            assert cell["multiplier"] in (0.25, 0.5, 1.0, 2.0, 4.0)
            tuned = res["tuning"][name][key]
            assert tuned["multiplier"] == cell["multiplier"]
            tried = [c["multiplier"] for c in tuned["grid"]]
            assert {0.5, 1.0} <= set(tried) and all(0.25 <= m <= 4.0 for m in tried)
            if tuned["found"] and not tuned["edge"]:
                assert min(tried) < cell["multiplier"] < max(tried)
            assert len(cell["runs"]) == 2
            for r in cell["runs"]:
                if r["status"] == "reached":
                    assert r["examples"] == r["steps"] * cell["batch"]
                    assert r["final_loss"] <= 0.5 and r["final_accuracy"] >= 0.5
                    # every step is evaluated while 3% of the steps is less than one step, so
                    # small step counts are exact; larger ones are resolved within 3%
                    assert r["resolution"] < config.SWEEP["eval_ratio"]
                    if r["steps"] <= 34:
                        assert r["resolution"] == 0
                    # probes at initialization and at every level down to the target
                    assert r["probes"][0]["level"] == "init"
                    assert r["probes"][-1]["level"] == pytest.approx(0.5)
        # batch 16 reaches the loose target well inside 3 epochs; the full batch makes 3 steps
        assert all(r["status"] == "reached" for r in per_batch["16"]["runs"])
        assert all(r["status"] != "reached" for r in per_batch["full"]["runs"])
    # every (optimizer, batch) pair is a row of the table, the unreached ones marked so
    measured = stdout.split("Measurement:")[1].split("Fit of")[0]
    rows = [r for r in _cells(measured) if r[0] != "optimizer"]
    assert len(rows) == 2 * 3
    assert [r[1] for r in rows] == ["16", "128", str(n)] * 2
    assert all(r[5] == "not reached (0/2)" for r in rows if r[1] == str(n)), measured
    assert "B_crit" in stdout and "B_noise" in stdout
    for name in ("sgd", "lamb"):
        s = res["summary"][name]
        # two batch sizes reached: the fit is exact through them, or refused with a reason
        assert ("b_crit" in s and s["b_crit"] > 0) or "fit_error" in s
        assert s["noise_by_level"]["init"]["value"] > 0


def test_unreached_pair_is_a_table_row_not_dropped():
    def run(status, steps):
        return dict(status=status, steps=steps, steps_run=steps or 7, final_accuracy=0.97)

    cfg = dict(seeds=(0, 1), batches=(16, 1024), bootstrap=10)
    results = {"lars": {
        "16": dict(batch=16, lr=1.25, multiplier=1.0,
                   runs=[run("reached", 900), run("reached", 1000)]),
        "1024": dict(batch=1024, lr=40.0, multiplier=0.5,
                     runs=[run("diverged", None), run("reached", 30)]),
    }}
    table = report.format_runs_table(cfg, results, 1438)
    row = next(r for r in _cells(table) if r[1] == "1024")
    assert row[4] == "diverged / 30" and row[5] == "not reached (1/2)" and row[6] == "-"
    summary = fit.summarize(cfg, results, noise=False)
    assert summary["lars"]["batches_in_fit"] == [16]
    assert "only 1 batch size" in summary["lars"]["fit_error"]
    assert "n/a: only 1 batch size" in report.format_summary_table(cfg, summary, noise=False)


@pytest.mark.parametrize("argv, message", [
    (["--batches", ","], "empty"),
    (["--batches", "16,abc"], "'abc' is not an integer"),
    (["--batches", "0,16"], "must be >= 1"),
    (["--batches", "4096"], "larger than the tuning split"),
    (["--target-loss", "0"], "never reached"),
    (["--target-accuracy", "1.5"], "never reached"),
    (["--optimizers", "adam"], "unknown ['adam']"),
    (["--seeds", ""], "--seeds '': empty"),
    (["--lr-grid", "1,-2"], "multipliers must be finite and > 0"),
    (["--tuning", "best"], "--tuning 'best'"),
    (["--lr-cap", "0"], "--lr-cap 0"),
    (["--set", "lars.nope=1"], "has no setting 'nope'"),
])
def test_bad_arguments_fail_clearly(argv, message, capsys, tmp_path):
    rc = cli_main(["demo", "sweep", *argv, "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_target_never_reached_fails_clearly(capsys, tmp_path):
    rc = cli_main(["demo", "sweep", "--batches", "64,full", "--optimizers", "sgd",
                   "--seeds", "0,1", "--lr-grid", "1", "--target-loss", "1e-6",
                   "--max-epochs", "0.5", "--no-noise-scale", "--no-progress",
                   "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "no run reached the target" in err and "--max-epochs" in err
    # the table is still printed, every pair marked as not reached
    assert out.count("not reached (0/2)") == 2


def test_sweep_help_and_demo_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", "sweep", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--quick", "--batches", "--seeds", "--lr-grid", "--tuning", "--lr-cap",
                "--target-loss", "--max-epochs"):
        assert opt in text


def test_tune_only_and_quick_configuration(tmp_path, capsys):
    rc = cli_main(["demo", "sweep", "--tune-only", "--batches", "64", "--optimizers", "sgd",
                   "--lr-grid", "1,2", "--tuning", "rule", "--target-loss", "0.5",
                   "--target-accuracy", "0.5",
                   "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "LR tuning on the validation split" in out and "Measurement" not in out
    res = json.loads((tmp_path / "sweep.json").read_text())
    cell = res["tuning"]["sgd"]["64"]
    # --tuning rule: the grid only, no widening
    assert cell["found"] and cell["multiplier"] in (1.0, 2.0)
    assert [c["multiplier"] for c in cell["grid"]] == [1.0, 2.0]
    assert res["config"]["tuning"] == "rule"
    assert (tmp_path / "sweep_tuning.md").exists() and not (tmp_path / "sweep.png").exists()
    # --quick swaps in its own defaults; explicit options still win
    cfg = config.make_config(cli.build_parser().parse_args(["--quick"]))
    assert cfg["batches"] == config.QUICK["batches"]
    assert cfg["probe_windows"] == config.QUICK["probe_windows"]
    cfg = config.make_config(cli.build_parser().parse_args(["--quick", "--batches", "16,full"]))
    assert cfg["batches"] == (16, "full")
    assert cfg["tuning"] == "wide" and cfg["lr_cap"] == config.SWEEP["lr_cap"]
