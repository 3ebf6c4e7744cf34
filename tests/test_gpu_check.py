"""benchmarks/gpu_check.py --dry-run: the GPU check's steps on CPU, with a tiny model, so that the script
the GPU run depends on cannot rot. Real parts: a 2-trial mode=run session read back from MLflow, repeats,
a hang killed at its timeout, an OOM from the memory limit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_the_gpu_check_runs_its_steps_on_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert all(report["checks"].values()), report["checks"]
    assert report["session"]["final_over_tuned"] is not None  # read back from the MLflow parent run
    assert report["hang"]["status"] == "timeout" and report["hang"]["processes_left"] == []
    assert report["oom"]["status"] == "oom"
    assert [r["status"] for r in report["repeats"]["runs"]] == ["ok", "ok"] and report["repeats"]["cv"] is not None
    assert len(report["skipped"]) == 4  # the GPU-only parts, named
    assert "| hang classified timeout | yes |" in (out / "gpu_check.md").read_text()


def test_without_wheels_the_gpu_run_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path / "out"), "--wheels", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "scripts/gpu_wheels.sh" in proc.stderr
