"""A script that misbehaves three ways at once, then fails: it starts a daemon in a session of its
own (setsid), so the experiment's process-group kill misses it; it prints a token from its
arguments and a secret from its environment; and it floods stderr with --flood_mb megabytes."""

import argparse
import os
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--marker", required=True)
parser.add_argument("--hf_token", required=True)
parser.add_argument("--flood_mb", type=int, default=0)
args, _ = parser.parse_known_args()
if os.environ.get("RANK", "0") == "0":
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(f"{args.marker}.{daemon.pid}", "w") as f:
        f.write(str(daemon.pid))
    print(f"token in the clear: {args.hf_token}; from the environment: {os.environ.get('MY_SERVICE_PASSWORD')}", flush=True)
    line = "flood " * 170 + "\n"  # ~1 KiB
    for _ in range(args.flood_mb * 1024):
        sys.stderr.write(line)
    sys.stderr.flush()
sys.exit(3)
