"""The session's report files, from an outcome built directly (no launches)."""

from mlautotune.run.experiment import Result
from mlautotune.track.report import write_reports
from mlautotune.search.ledger import Measured
from mlautotune.search.tuner import Outcome


def measured(name, stage, mbs, value, repeats=(), trial=0):
    metrics = {"throughput": value, "interval_rel": 0.05}
    return Measured({"stage": stage, "micro_batch": mbs, "gas": 1}, Result(name, "ok", metrics, "", 10.0, "", 0), trial, value, list(repeats))


def test_the_summary_counts_re_measurements_among_the_experiments(tmp_path):
    """A run that printed [8/8] must not report 7 experiments: re-measurements are launches too."""
    a = measured("z0_gas1_tmbspg4", 0, 4, 100.0, repeats=[98.0], trial=0)
    b = measured("z1_gas1_tmbspg4", 1, 4, 90.0, trial=2)
    outcome = Outcome(best=a, stage_best={0: a, 1: b}, measured=[a, b], experiments=3)
    write_reports(tmp_path, outcome, stages=[0, 1], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config=None, optimal_cmd=None)
    summary = (tmp_path / "summary.txt").read_text()
    assert "Total number of experiments: 3, 2 configurations and 1 re-measurement." in summary
    assert "over 2 measurements" in summary


def test_plots_of_a_session_where_every_experiment_failed_warn_nothing(tmp_path):
    """A script that crashes at import fails every experiment: the report still draws its plots, and
    the user sees no matplotlib warning about an empty legend."""
    import warnings

    from mlautotune.track.report import plot_session

    failed = Measured({"stage": 0, "micro_batch": 1, "gas": 1}, Result("z0_gas1_tmbspg1", "failed", {}, "ModuleNotFoundError", 1.0, "", 1), 0, None)
    outcome = Outcome(best=None, stage_best={}, measured=[failed], experiments=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = plot_session(tmp_path, outcome, "throughput")
    assert paths and all(p.stat().st_size > 1000 for p in paths)


def test_the_summary_names_the_configurations_the_measurements_cannot_rank_against_the_optimum(tmp_path):
    """A pick within the noise of others is not the only answer: the summary and session.json name
    the others, so a user may take the one that needs less memory or a smaller ZeRO stage."""
    import json

    a = measured("z2_gas1_tmbspg8", 2, 8, 100.0, repeats=[99.0], trial=0)
    b = measured("z1_gas1_tmbspg8", 1, 8, 98.0, trial=1)
    outcome = Outcome(best=a, stage_best={2: a, 1: b}, measured=[a, b], experiments=3, ties=[b])
    write_reports(tmp_path, outcome, stages=[1, 2], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config=None, optimal_cmd=None)
    summary = (tmp_path / "summary.txt").read_text()
    assert "Within the measurement interval of it, so as good as far as these measurements tell: z1_gas1_tmbspg8 98 (+-5.0%)" in summary
    assert json.loads((tmp_path / "session.json").read_text())["ties"] == ["z1_gas1_tmbspg8"]
