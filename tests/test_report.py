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


def test_every_file_gives_the_re_measured_winner_its_median(tmp_path):
    """The winner measured 90, 101 and 96: summary.txt, trials.csv, session.json, ds_config_optimal.json
    and the best-so-far curve all give 96, the median, not the first measurement."""
    import csv
    import json

    from mlautotune.track.report import _best_so_far

    a = measured("z0_gas1_tmbspg4", 0, 4, 90.0, repeats=[101.0, 96.0], trial=0)
    b = measured("z1_gas1_tmbspg4", 1, 4, 92.0, trial=1)
    outcome = Outcome(best=a, stage_best={0: a, 1: b}, measured=[a, b], experiments=4)
    write_reports(tmp_path, outcome, stages=[0, 1], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config={"train_micro_batch_size_per_gpu": 4}, optimal_cmd="deepspeed x")
    assert "Optimum: z0_gas1_tmbspg4  throughput=96 " in (tmp_path / "summary.txt").read_text()
    rows = {r["experiment"]: r for r in csv.DictReader((tmp_path / "trials.csv").open())}
    assert float(rows["z0_gas1_tmbspg4"]["throughput"]) == 96.0 and rows["z0_gas1_tmbspg4"]["measurements"] == "3"
    assert rows["z0_gas1_tmbspg4"]["values"] == "90 101 96"
    assert json.loads((tmp_path / "session.json").read_text())["metrics"]["best_throughput"] == 96.0
    assert json.loads((tmp_path / "ds_config_optimal.json").read_text())["mlautotune"]["value"] == 96.0
    assert _best_so_far(outcome, "throughput")[-1] == 96.0  # history.png and best_so_far.png


def disturbed(name, stage, mbs, value, wait, trial):
    m = measured(name, stage, mbs, value, trial=trial)
    m.result.metrics.update(disturbed=wait > 0.1, cpu_wait_share=wait)
    return m


def test_disturbed_measurements_are_counted_in_the_summary_and_the_record(tmp_path):
    import json

    a, b = disturbed("z0_gas1_tmbspg4", 0, 4, 100.0, 0.3, 0), disturbed("z0_gas1_tmbspg8", 0, 8, 90.0, 0.0, 1)
    outcome = Outcome(best=a, stage_best={0: a}, measured=[a, b], experiments=2)
    write_reports(tmp_path, outcome, stages=[0], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config=None, optimal_cmd=None)
    summary = (tmp_path / "summary.txt").read_text()
    assert "Warning: 1 of 2 measurements (50%) were disturbed: the ranks' training threads waited for a CPU 30% of the window" in summary
    assert "MOSTLY DISTURBED" not in summary
    record = json.loads((tmp_path / "session.json").read_text())
    assert record["metrics"]["disturbed_share"] == 0.5 and record["tags"]["disturbed"].startswith("1 of 2 measurements")


def test_a_mostly_disturbed_session_says_so_first_with_the_cause_and_the_fix(tmp_path):
    a, b = disturbed("z0_gas1_tmbspg4", 0, 4, 100.0, 0.4, 0), disturbed("z0_gas1_tmbspg8", 0, 8, 90.0, 0.5, 1)
    outcome = Outcome(best=a, stage_best={0: a}, measured=[a, b], experiments=2)
    write_reports(tmp_path, outcome, stages=[0], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config=None, optimal_cmd=None)
    first = (tmp_path / "summary.txt").read_text().splitlines()[0]
    assert first.startswith("MOSTLY DISTURBED: 2 of 2 measurements (100%) were disturbed")
    assert "other processes were using the cores" in first and "Tune on a machine that runs nothing else" in first


def test_a_session_the_budget_stopped_is_labelled_so_with_what_was_left(tmp_path):
    import json

    a = measured("z0_gas1_tmbspg4", 0, 4, 100.0, trial=0)
    outcome = Outcome(best=a, stage_best={0: a}, measured=[a], experiments=1, left=["z1_gas1_tmbspg4", "z1: its first look"])
    write_reports(tmp_path, outcome, stages=[0, 1], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config={"train_micro_batch_size_per_gpu": 4}, optimal_cmd="deepspeed x")
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("STOPPED BY THE BUDGET: the search was not finished. Next it would have measured z1_gas1_tmbspg4 (z1: its first look).")
    assert "Tuning stopped by the budget after" in summary
    record = json.loads((tmp_path / "session.json").read_text())
    assert record["tags"]["search"] == "stopped_by_budget" and record["tags"]["search_left"].startswith("z1_gas1_tmbspg4")
    assert json.loads((tmp_path / "ds_config_optimal.json").read_text())["mlautotune"]["search"] == "stopped_by_budget"
    finished = Outcome(best=a, stage_best={0: a}, measured=[a], experiments=1)
    write_reports(tmp_path, finished, stages=[0], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                  optimal_ds_config=None, optimal_cmd=None)
    assert json.loads((tmp_path / "session.json").read_text())["tags"]["search"] == "finished"


def test_result_files_are_readable_by_the_team(tmp_path):
    """Files get the mode the umask gives (0644 under 022), not mkstemp's 0600."""
    import os

    from mlautotune.files import atomic_write_text

    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "summary.txt", "x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_the_summary_names_how_a_warm_start_s_hardware_compares(tmp_path):
    """A warm start from a session on another memory size says so, not "other hardware": its peaks
    stood in for profiling, which other hardware's never do. A study recorded before the relation
    was kept still reads as same or other hardware."""
    import optuna

    a = measured("z0_gas1_tmbspg4", 0, 4, 100.0)
    outcome = Outcome(best=a, stage_best={0: a}, measured=[a], experiments=1)
    def study_with(**attrs):
        study = optuna.create_study(direction="maximize")
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        return study

    lines = {}
    for name, warm in [("memory", {"sessions": ["a"], "same_hardware": False, "relation": "another memory size"}),
                       ("older", {"sessions": ["a"], "same_hardware": False})]:
        write_reports(tmp_path / name, outcome, stages=[0], metric="throughput", status="complete", wall_time_s=30.0, session="s",
                      optimal_ds_config=None, optimal_cmd=None, study=study_with(warm_start=warm))
        lines[name] = next(x for x in (tmp_path / name / "summary.txt").read_text().splitlines() if x.startswith("Warm start"))
    assert lines == {"memory": "Warm start: from the earlier session a of the same model (another memory size).",
                     "older": "Warm start: from the earlier session a of the same model (other hardware)."}
