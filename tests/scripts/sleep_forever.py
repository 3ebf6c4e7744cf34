"""A training script that hangs (like a stuck collective): the experiment must end as `timeout`."""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--marker", required=True)
args, _ = parser.parse_known_args()
with open(f"{args.marker}.{os.getpid()}", "w") as f:  # proves the ranks were running when the timeout hit
    f.write(str(os.getpid()))
time.sleep(3600)
