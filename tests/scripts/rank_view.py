"""A rank that records what its interpreter gives it, then ends: the path, threads, random state, environment."""
import json
import os
import sys

import numpy
import torch

out = os.path.join(os.environ["VIEW_DIR"], f"view{os.environ['RANK']}.json")
with open(out, "w") as f:
    json.dump({"path": sys.path, "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
               "numpy_random": float(numpy.random.random_sample()), "argv": sys.argv[1:], "name": __name__}, f)
