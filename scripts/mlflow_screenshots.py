"""Screenshots of a tuning session in the MLflow UI: the runs table, the parent run and the compare view.

    python scripts/mlflow_screenshots.py [--tracking-uri sqlite:///mlflow.db] [--experiment mlautotune] [--out mlflow_screenshots]

It starts `mlflow ui` on 127.0.0.1 only (a free port), finds the experiment's latest parent run
(tag mlautotune.role=session) and its experiments' runs with MlflowClient, and has headless Chromium
(`apt-get install chromium`) draw three pages into PNGs: runs_table.png (the experiment's runs in
the view the session's console link opens: the metrics as columns, sorted by the best), parent.png (the parent run's page) and compare.png (MLflow's
Compare of the experiments' runs). The server is stopped at the end. Nothing is written to the
store. Look at the PNGs to see what a user sees.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ui(tracking_uri: str, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600  # minutes on a loaded machine
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"mlflow ui ended with status {proc.returncode}")
            time.sleep(1)
    stop(proc)
    raise SystemExit("mlflow ui did not answer within 600 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def pages(tracking_uri: str, experiment: str, base: str) -> dict:
    """The three pages' URLs for the experiment's latest parent run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
    parents = client.search_runs([exp.experiment_id], "tags.`mlautotune.role` = 'session'", order_by=["attributes.start_time DESC"], max_results=1)
    if not parents:
        raise SystemExit(f"the experiment {experiment!r} has no tuning session (a run tagged mlautotune.role=session)")
    parent = parents[0]
    children = client.search_runs([exp.experiment_id], f"tags.`mlautotune.session_run` = '{parent.info.run_id}'", max_results=50)
    metric = parent.data.tags.get("metric", "throughput")
    # the shared view the session writes (an experiment tag): the runs table with the metrics as columns
    order = urllib.parse.urlencode({"viewStateShareKey": "mlautotune", "workflowType": "machine_learning"})
    compare = urllib.parse.urlencode({"runs": json.dumps([r.info.run_id for r in children]), "experiments": json.dumps([exp.experiment_id])})
    return {
        "runs_table": f"{base}/#/experiments/{exp.experiment_id}/runs?{order}",
        "parent": f"{base}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning",
        "compare": f"{base}/#/compare-runs?{compare}",
    }


def screenshot(browser: str, url: str, path: Path, wait_ms: int) -> None:
    argv = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1600,1000",
            f"--virtual-time-budget={wait_ms}", f"--screenshot={path}", url]
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    parser.add_argument("--experiment", default="mlautotune")
    parser.add_argument("--out", default="mlflow_screenshots")
    parser.add_argument("--wait-ms", type=int, default=20000, help="how long the page's scripts run before the shot")
    parser.add_argument("--ui-url", help="an MLflow UI already serving that store (e.g. http://127.0.0.1:5000); none is started then")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no Chromium here: install it (apt-get install chromium)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = None if args.ui_url else start_ui(args.tracking_uri, port)
    try:
        for name, url in pages(args.tracking_uri, args.experiment, (args.ui_url or f"http://127.0.0.1:{port}").rstrip("/")).items():
            screenshot(browser, url, out / f"{name}.png", args.wait_ms)
            print(f"{out / (name + '.png')}: {url}")
    finally:
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    main()
