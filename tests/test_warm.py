"""Warm start: finding earlier sessions of the same model (search/earlier.py) on a real sqlite Optuna
storage and (track/earlier_runs.py) in a real MLflow store written by the project's Tracker, the
switch search.warm_start, what `mlautotune plan` says of it, and two real sessions where the second
starts from the first."""

import io
import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from mlautotune.commands import recorded_earlier, warm_start, warm_tags
from mlautotune.console import Console
from mlautotune.search.earlier import MAX_SESSIONS, find_earlier, fingerprint
from mlautotune.search.ledger import measured_in
from mlautotune.track.earlier_runs import find_earlier_runs
from mlautotune.track.tracking import Tracker
from mlautotune.workloads import GPT_SCRIPT

HARDWARE = {"accelerator": "cpu", "device_memory_bytes": None, "world_size": 2, "memory_limit_per_rank": 2**31}
DISTS = {"stage": CategoricalDistribution([0, 1, 2, 3]), "micro_batch": CategoricalDistribution([1, 2, 4, 8]), "gas": CategoricalDistribution([1])}


def trial(mbs, status="ok", value=None, **attrs):
    """A finished trial as Ledger.record writes it (interrupted: FAIL without a result)."""
    params = {"stage": 0, "micro_batch": mbs, "gas": 1}
    if status == "interrupted":
        return create_trial(params=params, distributions=DISTS, state=TrialState.FAIL, user_attrs={"params": params, "status": "interrupted"})
    result = {"name": f"z0_gas1_tmbspg{mbs}", "status": status, "metrics": {"throughput": value, "num_params": 1000} if value else {}}
    return create_trial(params=params, distributions=DISTS, state=TrialState.COMPLETE if value else TrialState.FAIL, value=value,
                        user_attrs={"params": params, "status": status, "result": result, **attrs})


def study(storage, name, key, hardware=HARDWARE, trials=()):
    s = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    s.set_user_attr("fingerprint", key)
    s.set_user_attr("hardware", hardware)
    for t in trials:
        s.add_trial(t)
    return s


def snapshot(storage):
    """Everything in the storage that a reader could change."""
    out = {}
    for summary in optuna.get_all_study_summaries(storage):
        s = optuna.load_study(study_name=summary.study_name, storage=storage)
        out[summary.study_name] = (dict(s.user_attrs), [(t.number, t.state, t.value, dict(t.user_attrs), dict(t.params)) for t in s.trials])
    return out


def test_find_earlier_matches_the_fingerprint_prefers_the_same_hardware_and_only_reads(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study(storage, "old", "k", trials=[trial(1, value=10.0), trial(2, value=20.0), trial(2, value=22.0, repeat_of=1),
                                       trial(4, "oom"), trial(8, "interrupted")])
    study(storage, "other-model", "x", trials=[trial(1, value=99.0)])
    study(storage, "elsewhere", "k", hardware={**HARDWARE, "world_size": 8}, trials=[trial(1, value=5.0)])
    study(storage, "me", "k")  # this session's own study is never its own warm start
    before = snapshot(storage)

    earlier = find_earlier(storage, "me", "k", HARDWARE)
    assert earlier.sessions == ["old"] and earlier.same_hardware
    assert [(m.params["micro_batch"], m.result.status, m.value, m.repeats) for m in earlier.runs] == [(1, "ok", 10.0, []), (2, "ok", 20.0, [22.0]), (4, "oom", None, [])]
    assert sorted(m.trial_number for m in earlier.runs) == [-3, -2, -1]
    assert earlier.num_params == 1000 and "3 experiments" not in earlier.about["old"] and "4 experiments" in earlier.about["old"]
    assert snapshot(storage) == before  # read-only

    other = find_earlier(storage, "me", "k", {**HARDWARE, "world_size": 4})  # none on this hardware: the others are used
    assert set(other.sessions) == {"old", "elsewhere"} and not other.same_hardware and not other.same_ranks
    smaller = find_earlier(storage, "me", "k", {**HARDWARE, "memory_limit_per_rank": 2**30})  # another memory size only: peaks hold
    assert not smaller.same_hardware and smaller.same_ranks
    assert earlier.same_ranks
    elsewhere = find_earlier(storage, "me", "k", {**HARDWARE, "accelerator": "cuda"})  # another accelerator: its peaks say nothing here
    assert not elsewhere.same_ranks and not elsewhere.same_accelerator and other.same_accelerator
    assert [(earlier.relation, smaller.relation, other.relation, elsewhere.relation)] == [
        ("same hardware", "another memory size", "another world size", "other hardware")]
    # each run carries the world size it ran at (the probe records it; here from the session's hardware): its peak moves from there
    assert sorted({m.result.metrics["world_size"] for m in other.runs if m.ok}) == [2, 8]
    assert find_earlier(storage, "me", "nothing-like-it", HARDWARE) is None
    broken = study(storage, "broken", "k")  # the newest: a result that is no result
    broken.add_trial(create_trial(params={"stage": 0, "micro_batch": 1, "gas": 1}, distributions=DISTS, value=1.0, user_attrs={"result": "garbage"}))
    notes = []
    assert find_earlier(storage, "me", "k", HARDWARE, note=notes.append).sessions == ["old"]
    assert len(notes) == 1 and "skipped the earlier session broken" in notes[0]
    missing = tmp_path / "none.db"
    assert find_earlier(f"sqlite:///{missing}", "me", "k", HARDWARE) is None and not missing.exists()


def test_find_earlier_takes_the_newest_sessions(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    for i in range(MAX_SESSIONS + 1):
        study(storage, f"s{i}", "k", trials=[trial(1, value=float(i + 1))])  # created in order: s3 is the newest
    earlier = find_earlier(storage, "me", "k", HARDWARE)
    assert earlier.sessions == [f"s{i}" for i in range(MAX_SESSIONS, 0, -1)]
    assert len({m.trial_number for m in earlier.runs}) == MAX_SESSIONS


def test_the_fingerprint_is_the_model_not_the_other_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    ds = {"optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}}
    base = fingerprint(script, ds, ["--seq_len", "128", "--lr", "1e-3"])
    assert fingerprint(script, ds, ["--lr", "3e-4", "--seq_len", "128", "--steps", "9"]) == base
    assert fingerprint(script, ds, ["--seq_len", "256", "--lr", "1e-3"]) != base
    assert fingerprint(script, {**ds, "bf16": {"enabled": False}}, ["--seq_len", "128"]) != base
    assert fingerprint(script, {**ds, "optimizer": {"type": "Lamb"}}, ["--seq_len", "128"]) != base
    script.write_text("print('train, another model')\n")
    assert fingerprint(script, ds, ["--seq_len", "128", "--lr", "1e-3"]) != base


def earlier_and_me(tmp_path, on):
    """A storage with an earlier session "old" of the workload's model, this session's empty study "me",
    and a stand-in session with search.warm_start=on."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = ["--seq_len", "32"]
    key = fingerprint(GPT_SCRIPT, {}, args)
    study(storage, "old", key, trials=[trial(2, value=20.0)])
    me = optuna.create_study(storage=storage, study_name="me", direction="maximize")
    return storage, key, me, stand_in(storage, args, on)


def stand_in(storage, args, warm=True, tracking_uri=None):
    """A session as warm_start reads it: the workload's model on 2 CPU ranks with a 2 GiB limit (HARDWARE)."""
    cfg = {"search": {"warm_start": warm}, "autotuning": {"metric": "throughput"},
           "tracking": {"enabled": True, "tracking_uri": tracking_uri, "experiment_name": "mlautotune"}}
    return SimpleNamespace(script=GPT_SCRIPT, ds_config={}, script_args=args, device="cpu", world_size=2, memory_limit_bytes=2**31,
                           storage=storage, name="me", cfg=OmegaConf.create(cfg), at=OmegaConf.create(cfg["autotuning"]))


@pytest.mark.parametrize("on", [True, False], ids=["warm_start=true", "warm_start=false"])
def test_search_warm_start_false_makes_no_lookup(tmp_path, on):
    storage, key, me, session = earlier_and_me(tmp_path, on)
    out = io.StringIO()
    earlier = warm_start(session, me, Console("throughput", 5, stream=out))
    assert me.user_attrs["fingerprint"] == key and me.user_attrs["hardware"] == HARDWARE
    if on:
        assert earlier.sessions == ["old"] and me.user_attrs["warm_start"]["sessions"] == ["old"]
        assert "warm start: from old (" in out.getvalue() and "same hardware" in out.getvalue()
    else:
        assert earlier is None and me.user_attrs["warm_start"] is None and "warm start" not in out.getvalue()


def test_a_resumed_session_and_a_report_start_from_the_sessions_it_started_from(tmp_path):
    """A resumed session (or another worker, or `mlautotune report`) uses the earlier sessions recorded
    on its study, and not one that appeared since: the same prior, the same declared optimum."""
    storage, key, me, session = earlier_and_me(tmp_path, True)
    assert warm_start(session, me, Console("throughput", 5, stream=io.StringIO())).sessions == ["old"]
    me.add_trial(trial(4, value=30.0))  # the session ran, then stopped
    study(storage, "newer", key, trials=[trial(8, value=40.0)])  # another session of the model, since
    assert find_earlier(storage, "me", key, HARDWARE).sessions == ["newer", "old"], "a fresh lookup would take it"
    resumed = warm_start(session, optuna.load_study(study_name="me", storage=storage), Console("throughput", 5, stream=io.StringIO()))
    assert resumed.sessions == ["old"] and recorded_earlier(session, me).sessions == ["old"]


KNOBS = {**DISTS, "overlap_comm": CategoricalDistribution([True, False])}


def measured_trial(mbs, status, value=None, reason="", **attrs):
    """A finished trial as Ledger.record writes it, with the metrics a probe reports and a knob."""
    params = {"stage": 1, "micro_batch": mbs, "gas": 1, "overlap_comm": mbs % 2 == 0}
    metrics = {"throughput": value, "peak_memory_bytes": 2**20 * mbs, "interval_rel": 0.01 * mbs, "disturbed": False,
               "num_params": 123456, "trainable_num_params": 123456} if value else {}
    result = {"name": f"z1_gas1_tmbspg{mbs}", "status": status, "metrics": metrics, "reason": reason, "wall_time_s": 3.0 + mbs}
    return create_trial(params=params, distributions=KNOBS, state=TrialState.COMPLETE if value else TrialState.FAIL, value=value,
                        user_attrs={"params": params, "status": status, "result": result, **attrs})


def tracked_session(tmp_path, key, hardware=HARDWARE, parent_params=None, tags=None):
    """A first session's study ("first": mbs 1 ok, mbs 2 ok and measured again, mbs 4 OOM, mbs 8 cut
    off) and its MLflow runs, logged by the Tracker as a session logs them: the parent with warm_tags,
    the experiment runs from the study (fill_in), each configuration's median, the closing tags."""
    storage, uri = f"sqlite:///{tmp_path / 'first.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = study(storage, "first", key, hardware, trials=[
        measured_trial(1, "ok", 10.0), measured_trial(2, "ok", 20.0), measured_trial(2, "ok", 23.0, repeat_of=1),
        measured_trial(4, "oom", reason="CUDA out of memory"), trial(8, "interrupted")])
    first.set_user_attr("optimum", {"experiment": "z1_gas1_tmbspg2"})
    tracker = Tracker(uri, "mlautotune", say=lambda text: None)
    tracker.open_parent(first, "first", {"session": "first", **(parent_params or {})},
                        {"metric": "throughput", **(warm_tags(first) if tags is None else tags)}, [])
    tracker.fill_in(first, 2**31)
    for m in measured_in(first.trials):
        if m.repeats:
            tracker.log_configuration(m.trial_number, "throughput", m.values, m.final_value, step=len(first.trials))
    tracker.close_parent({}, {"best_experiment": "z1_gas1_tmbspg2"}, [], "FINISHED")
    return storage, uri, first, tracker.parent_id


def as_read(earlier):
    """What the search reads of each earlier measurement."""
    keys = ("throughput", "peak_memory_bytes", "interval_rel", "disturbed", "num_params", "trainable_num_params")
    return [(m.params, m.result.name, m.result.status, m.value, m.repeats, m.result.wall_time_s, m.result.reason.strip(),
             {k: m.result.metrics.get(k) for k in keys}, m.trial_number) for m in earlier.runs]


def test_the_mlflow_store_gives_the_measurements_the_study_holds(tmp_path):
    key = fingerprint(GPT_SCRIPT, {}, ["--seq_len", "32"])
    storage, uri, first, parent = tracked_session(tmp_path, key)
    db = tmp_path / "mlflow.db"
    before = (db.read_bytes(), db.stat().st_mtime_ns)

    from_study = find_earlier(storage, "me", key, HARDWARE)
    fresh = tmp_path / "fresh.db"
    assert find_earlier(f"sqlite:///{fresh}", "me", key, HARDWARE) is None and not fresh.exists()
    from_mlflow = find_earlier_runs(uri, "mlautotune", key, HARDWARE, "throughput")
    assert from_mlflow.sessions == ["first"] and from_mlflow.same_hardware and from_mlflow.store == uri
    assert as_read(from_mlflow) == as_read(from_study)
    assert [(m.params, m.result.status, m.value, m.repeats) for m in from_mlflow.runs] == [
        ({"stage": 1, "micro_batch": 1, "gas": 1, "overlap_comm": False}, "ok", 10.0, []),
        ({"stage": 1, "micro_batch": 2, "gas": 1, "overlap_comm": True}, "ok", 20.0, [23.0]),
        ({"stage": 1, "micro_batch": 4, "gas": 1, "overlap_comm": True}, "oom", None, [])]
    assert from_mlflow.num_params == 123456 and "4 experiments" in from_mlflow.about["first"] and "optimum z1_gas1_tmbspg2" in from_mlflow.about["first"]

    other = find_earlier_runs(uri, "mlautotune", key, {**HARDWARE, "world_size": 4}, "throughput")
    assert not other.same_hardware and "on cpu x2" in other.about["first"]
    assert find_earlier_runs(uri, "mlautotune", fingerprint(GPT_SCRIPT, {}, ["--seq_len", "64"]), HARDWARE, "throughput") is None
    assert find_earlier_runs(uri, "mlautotune", key, HARDWARE, "throughput", exclude=parent) is None  # a session's own parent run
    assert find_earlier_runs(uri, "mlautotune", key, HARDWARE, "throughput", only=["another"]) is None
    assert find_earlier_runs(uri, "another-experiment", key, HARDWARE, "throughput") is None
    assert (db.read_bytes(), db.stat().st_mtime_ns) == before  # read-only

    missing = tmp_path / "none.db"
    assert find_earlier_runs(f"sqlite:///{missing}", "mlautotune", key, HARDWARE, "throughput") is None and not missing.exists()
    (tmp_path / "garbage.db").write_bytes(b"not a database" * 100)
    notes = []
    assert find_earlier_runs(f"sqlite:///{tmp_path / 'garbage.db'}", "mlautotune", key, HARDWARE, "throughput", note=notes.append) is None
    assert len(notes) == 1 and "could not be read" in notes[0] and "starting cold" in notes[0]
    notes = []
    assert find_earlier_runs("http://someone:pw1234secret@127.0.0.1:9", "mlautotune", key, HARDWARE, "throughput", note=notes.append) is None
    assert len(notes) == 1 and "pw1234secret" not in notes[0] and "127.0.0.1:9" in notes[0]


def test_a_parent_run_without_the_hardware_tag_is_matched_by_its_hardware_params(tmp_path):
    """A parent logged before the `hardware` tag existed has only its fingerprint tag and the hardware.*
    params every parent run logs: the same facts, so the same hardware is still recognised."""
    key = fingerprint(GPT_SCRIPT, {}, ["--seq_len", "32"])
    params = {"hardware.accelerator": "cpu", "hardware.world_size": 2, "hardware.memory_limit_per_rank_bytes": 2**31, "hardware.host": "h"}
    _, uri, _, _ = tracked_session(tmp_path, key, parent_params=params, tags={"fingerprint": key})
    assert find_earlier_runs(uri, "mlautotune", key, HARDWARE, "throughput").same_hardware
    assert not find_earlier_runs(uri, "mlautotune", key, {**HARDWARE, "world_size": 4}, "throughput").same_hardware


def test_a_session_in_a_fresh_storage_starts_from_the_mlflow_store_and_resumes_from_it(tmp_path):
    key = fingerprint(GPT_SCRIPT, {}, ["--seq_len", "32"])
    _, uri, _, _ = tracked_session(tmp_path, key)
    storage = f"sqlite:///{tmp_path / 'fresh.db'}"
    me = optuna.create_study(storage=storage, study_name="me", direction="maximize")
    session = stand_in(storage, ["--seq_len", "32"], tracking_uri=uri)
    out = io.StringIO()
    earlier = warm_start(session, me, Console("throughput", 5, stream=out))
    assert earlier.sessions == ["first"] and me.user_attrs["warm_start"] == {"sessions": ["first"], "same_hardware": True, "relation": "same hardware",
                                                                   "store": "mlflow"}
    assert f"warm start: from first (" in out.getvalue() and f") in the MLflow store {uri}; same hardware" in out.getvalue()
    assert warm_tags(me)["warm_start"] == "first" and json.loads(warm_tags(me)["hardware"]) == HARDWARE

    me.add_trial(trial(4, value=30.0))  # the session ran, then stopped: it resumes from the same runs
    assert [m.value for m in recorded_earlier(session, me).runs] == [m.value for m in earlier.runs]
    off = stand_in(storage, ["--seq_len", "32"], tracking_uri=uri)
    off.cfg.tracking.enabled = False
    assert recorded_earlier(off, me) is None
    out = io.StringIO()
    assert warm_start(off, optuna.create_study(storage=storage, study_name="other", direction="maximize"), Console("throughput", 5, stream=out)) is None
    assert "MLflow" not in out.getvalue()


def test_the_plan_says_whether_the_session_would_warm_start_and_writes_nothing(tmp_path, monkeypatch):
    """`mlautotune plan` through the command line: an earlier session's study written as a session
    writes it (open_study, warm_start), then the plan's line, with the storage's bytes, its time and
    the study's attributes as they were, and no MLflow store created."""
    from hydra import compose, initialize_config_dir
    from test_bad_inputs import run_cli
    from test_session import TINY_MODEL, write_config

    from mlautotune.inputs.config import register_configs
    from mlautotune.session import open_session

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = write_config(tmp_path / "ds.json", [1, 2], [0])
    common = [f"config={config}", f"script={GPT_SCRIPT}", f"script_args='{' '.join(TINY_MODEL)}'", "launcher.num_gpus=2",
              f"autotuning.results_dir={tmp_path / 'results'}"]
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "src" / "mlautotune" / "conf"), version_base="1.3"):
        earlier_session = open_session(compose(config_name="config", overrides=[*common, "search.session=old"]), dry_run=True)
    earlier_session.results_dir.mkdir()  # as a session makes it
    old = earlier_session.open_study()
    warm_start(earlier_session, old, Console("throughput", 5, stream=io.StringIO()))
    for t in (trial(1, value=10.0), trial(2, value=20.0), trial(4, "oom")):
        old.add_trial(t)
    old.set_user_attr("optimum", {"experiment": "z0_gas1_tmbspg2"})
    db = tmp_path / "results" / "optuna.db"
    before = (db.read_bytes(), db.stat().st_mtime_ns, snapshot(earlier_session.storage))
    started = optuna.get_all_study_summaries(earlier_session.storage)[0].datetime_start

    def plan(*extra):
        code, out, err = run_cli(tmp_path, ["plan", *common, *extra])
        assert code == 0, err
        return [line for line in out.splitlines() if line.startswith("warm start:")]

    assert plan() == [f"warm start: from old ({started:%Y-%m-%d %H:%M}, 3 experiments, optimum z0_gas1_tmbspg2); same hardware: the earlier "
                      "optimum and its near-ties are measured first; the first run's parameter count confirms it is the same model"]
    assert plan("search.warm_start=false") == ["warm start: off (search.warm_start=false)"]
    fresh = tmp_path / "fresh.db"
    assert plan(f"search.storage=sqlite:///{fresh}") == [f"warm start: no earlier session of this model in sqlite:///{fresh} "
                                                         f"or the MLflow store sqlite:///{tmp_path / 'mlflow.db'}"]
    assert (db.read_bytes(), db.stat().st_mtime_ns, snapshot(earlier_session.storage)) == before
    assert not fresh.exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.e2e
def test_a_second_session_with_one_argument_changed_starts_from_the_first(tmp_path):
    """Stages 0 and 3, micro-batches 1, 2, 4, 8: the first session runs more than 3 experiments (by its
    stop rule or its budget of 16). On the CPU accelerator z3 is about 5x slower than z0 at micro-batch
    8, so no configuration is a near-tie of the optimum. With stages 0 and 1, or 0 and 2 (1348 against
    1989 samples/s), a loaded machine's disturbed measurements made them near-ties, which the search
    rightly re-measures as often as the load needs: 5 and 4 experiments in the second session in CI.
    The second session changes the workload's --seed, which does not change the model. A third, the
    second's settings in a new results folder, finds both in the MLflow store."""
    from test_session import QUICK, TINY_MODEL, cli, finish, runs, write_config

    config = write_config(tmp_path / "ds.json", [1, 2, 4, 8], [0, 3], tuner_type="model_based", tuner_num_trials=16)
    common = [f"config={config}", f"script={GPT_SCRIPT}", "launcher.num_gpus=2", *QUICK]
    code, out = finish(cli(tmp_path, *common, f"script_args={' '.join(TINY_MODEL)}", script=None))
    assert code == 0, out
    assert "warm start: no earlier session of this model in" in out
    (first,) = runs(tmp_path, "session")
    first_name = first.data.params["session"]
    assert first.data.tags["search"] in ("finished", "stopped_by_budget")
    assert first.data.metrics["num_experiments"] > 3, out  # so that a second session's 3 experiments at most are the warm start's doing

    code, out = finish(cli(tmp_path, *common, f"script_args={' '.join(TINY_MODEL + ['--seed', '7'])}", script=None))
    assert code == 0, out
    assert f"warm start: from {first_name} (" in out and "same hardware" in out, out
    (second,) = [r for r in runs(tmp_path, "session") if r.info.run_id != first.info.run_id]
    second_name = second.data.params["session"]
    assert second_name != first_name and second.data.tags["warm_start"] == first_name
    assert second.data.tags["fingerprint"] == first.data.tags["fingerprint"]
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert f"Warm start: from the earlier session {first_name} of the same model (same hardware)." in summary

    storage = f"sqlite:///{tmp_path / 'autotuning_results' / 'optuna.db'}"
    earlier = optuna.load_study(study_name=first_name, storage=storage)
    now = optuna.load_study(study_name=second_name, storage=storage)
    launched = sorted((t for t in now.trials if "result" in t.user_attrs), key=lambda t: t.number)
    # the earlier optimum first, and at most 3 experiments in all
    assert launched[0].user_attrs["name"] == earlier.user_attrs["optimum"]["experiment"], [t.user_attrs["name"] for t in launched]
    assert len(launched) <= 3, [t.user_attrs["name"] for t in launched]
    a, b = earlier.user_attrs["optimum"], now.user_attrs["optimum"]
    interval = first.data.metrics["best_interval_rel"]
    assert b["experiment"] == a["experiment"] or abs(b["throughput"] - a["throughput"]) <= interval * a["throughput"], (a, b, interval)
    assert json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())["mlautotune"]["session"] == second_name

    # a third, in a new results folder (a fresh study storage): the same two sessions, from the MLflow store
    code, out = finish(cli(tmp_path, *common, f"script_args={' '.join(TINY_MODEL + ['--seed', '7'])}", f"autotuning.results_dir={tmp_path / 'elsewhere'}", script=None))
    assert code == 0, out
    assert f"warm start: from {second_name} (" in out and f"{first_name} (" in out, out
    assert f") in the MLflow store sqlite:///{tmp_path / 'mlflow.db'}; same hardware" in out, out
    (third,) = [r for r in runs(tmp_path, "session") if r.info.run_id not in (first.info.run_id, second.info.run_id)]
    assert third.data.tags["warm_start"] == f"{second_name},{first_name}" and third.data.tags["hardware"] == second.data.tags["hardware"]
    assert "found in the MLflow store" in (tmp_path / "elsewhere" / "summary.txt").read_text()
