"""The bundled workload (src/mlautotune/workloads/gpt.py), accepting --deepspeed_config either as a
path or as base64-encoded JSON, which is how DeepSpeed's autotuner hands each experiment its config.
gpt.py itself opens the value as a file (to fill "auto" batch values), so under `deepspeed
--autotuning` every experiment would fail; versus_deepspeed.py runs this wrapper for BOTH tools, so
they tune the same script."""

import base64
import os
import runpy
import sys
import tempfile

from mlautotune.workloads import GPT_SCRIPT

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--deepspeed_config" in argv:
        i = argv.index("--deepspeed_config") + 1
        if i < len(argv) and not os.path.exists(argv[i]):
            fd, path = tempfile.mkstemp(suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(base64.urlsafe_b64decode(argv[i]).decode("utf-8"))
            argv[i] = path
    sys.argv = [str(GPT_SCRIPT), *argv]
    runpy.run_path(str(GPT_SCRIPT), run_name="__main__")
