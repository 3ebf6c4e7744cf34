"""Every user mistake: a one-paragraph message naming the problem and the fix, exit status 2, no
traceback, and nothing written that looks like a result. Runs the real command line (`plan`, which
validates everything a tuning session does and launches nothing).

docs/bad-inputs.md is this table: `python tests/test_bad_inputs.py > docs/bad-inputs.md` rewrites it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

OK_AT = {"enabled": True}

# (case, ds_config text or None for "missing file", extra CLI args, expected message fragment)
CASES = [
    ("config file that is not there", None, [], "does not exist"),
    ("JSON that does not parse", '{"train_micro_batch_size_per_gpu": 1,\n  "autotuning": {"enabled": tru}}', [], "line 2, column"),
    ("top level is not an object", "[1, 2]", [], "is not a JSON object"),
    ("autotuning section missing", {"train_micro_batch_size_per_gpu": 1}, [], '"autotuning": {"enabled": true}'),
    ("autotuning not enabled", {"autotuning": {"enabled": False}}, [], '"autotuning": {"enabled": true}'),
    ("unknown key in autotuning", {"autotuning": {"enabled": True, "tuner_typ": "random"}}, [], "unknown key 'tuner_typ'"),
    ("unknown tuner_type", {"autotuning": {"enabled": True, "tuner_type": "bayes"}}, [], "not a known tuner"),
    ("unknown metric", {"autotuning": {"enabled": True, "metric": "speed"}}, [], "not a known metric"),
    ("stage outside 0-3", {"zero_optimization": {"stage": 4}, "autotuning": OK_AT}, [], "is not a ZeRO stage"),
    ("micro-batch not a positive integer", {"train_micro_batch_size_per_gpu": [2, -1], "autotuning": OK_AT}, [], "not a positive integer"),
    ("end_profile_step < start_profile_step", {"autotuning": {"enabled": True, "start_profile_step": 5, "end_profile_step": 3}}, [], "smaller than start_profile_step"),
    ('"auto" with no mapping and no flag', {"train_micro_batch_size_per_gpu": "auto", "autotuning": OK_AT}, [], "does not map it to a flag"),
    ("arg_mappings flag without --", {"autotuning": {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "per_device_train_batch_size"}}}, [], "not a command-line flag"),
    ("gradient accumulation list", {"gradient_accumulation_steps": [1, 2], "autotuning": OK_AT}, [], "not supported"),
    ("max_train_batch_size below the smallest batch", {"train_micro_batch_size_per_gpu": 4, "autotuning": {"enabled": True, "max_train_batch_size": 2}}, ["launcher.num_gpus=2"], "smaller than the smallest possible batch"),
    ("non-numeric value in a knob list", {"zero_optimization": {"stage": 1, "reduce_bucket_size": [5e7, "big"]}, "autotuning": OK_AT}, [], "not a number or true/false"),
    ("script that is not there", {"autotuning": OK_AT}, ["script=/nonexistent/train.py"], "does not exist"),
    ("script that is not Python", {"autotuning": OK_AT}, ["script=@TXT@"], "not a Python file"),
    ("hostfile that is not there", {"autotuning": OK_AT}, ["launcher.hostfile=/nonexistent/hostfile"], "does not exist"),
    ("malformed hostfile", {"autotuning": OK_AT}, ["launcher.hostfile=@BADHOSTS@"], "malformed"),
    ("num_gpus larger than the hosts offer", {"autotuning": OK_AT}, ["launcher.hostfile=@HOSTS@", "launcher.num_gpus=8"], "more than the hosts offer"),
    ("results directory that cannot be written", {"autotuning": {"enabled": True, "results_dir": "/proc/mlautotune"}}, [], "cannot be written"),
    ("tracking URI that cannot be parsed", {"autotuning": OK_AT}, ["tracking.tracking_uri=bogus-scheme://x"], "cannot be used"),
    ("memory limit that is not a size", {"autotuning": {"enabled": True, "memory_limit_per_rank": "lots"}}, [], "is not a size"),
    ("script_args with an open quote", {"autotuning": OK_AT}, ["script_args='--name \"x'"], "cannot be split"),
]


def run_case(tmp_path: Path, ds, extra):
    cfg = tmp_path / "ds.json"
    if ds is not None:
        cfg.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    (tmp_path / "badhosts").write_text("localhost slots=two\n")
    subs = {"@TXT@": str(tmp_path / "notes.txt"), "@HOSTS@": str(tmp_path / "hosts"), "@BADHOSTS@": str(tmp_path / "badhosts")}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in extra]
    return subprocess.run([sys.executable, "-m", "mlautotune", "plan", f"config={cfg}", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case,ds,extra,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(tmp_path, case, ds, extra, fragment):
    proc = run_case(tmp_path, ds, extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mlautotune: error:")]
    assert len(lines) == 1, proc.stderr
    assert fragment in lines[0]
    assert not (tmp_path / "autotuning_results" / "ds_config_optimal.json").exists()


def test_a_typo_in_an_override_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlautotune", "plan", "autotuning.tuner_typ=random"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "tuner_typ" in proc.stderr and "Traceback" not in proc.stderr


if __name__ == "__main__":  # regenerate docs/bad-inputs.md
    import tempfile

    print("# Bad inputs and their messages\n")
    print("Every case below is run by `tests/test_bad_inputs.py` through `mlautotune plan`; each exits with status 2.\n")
    print("| bad input | message |\n|---|---|")
    for case, ds, extra, _ in CASES:
        with tempfile.TemporaryDirectory() as d:
            err = [l for l in run_case(Path(d), ds, extra).stderr.splitlines() if l.startswith("mlautotune: error:")]
            msg = err[0].replace(d, "<tmp>").replace("|", "\\|") if err else "(no message)"
        print(f"| {case} | {msg} |")
