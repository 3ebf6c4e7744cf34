"""`mlautotune-deepspeed`: the DeepSpeed launcher's command line, running an mlautotune session.

    mlautotune-deepspeed --num_gpus 8 [--num_nodes N] [--hostfile F] [--include/--exclude S] [--master_port P]
                         [--autotuning tune|run] train.py --deepspeed ds.json [script args]

is `deepspeed --autotuning tune ...` with mlautotune's tuner. The launcher's arguments are parsed by
DeepSpeed's own parser (deepspeed.launcher.runner.parse_args); the ds_config is the script's
--deepspeed / --deepspeed_config / --deepspeed-config value. It runs the same session as
`mlautotune config=ds.json script=train.py script_args='...' launcher.num_gpus=8`.
"""

import shlex
import sys
from typing import List, Optional

from mlautotune.cli import fail, hydra_quote
from mlautotune.cli import main as mlautotune_main
from mlautotune.errors import UserError
from mlautotune.inputs.scriptargs import DEEPSPEED_CONFIG_FLAGS, get_flag

# DeepSpeed launcher switches passed on as they are (LauncherConf.launcher_args).
SWITCHES = ("no_ssh", "no_ssh_check", "force_multi", "bind_cores_to_rank", "save_pid")
VALUED = ("master_addr", "node_rank", "bind_core_list", "ssh_port", "launcher_args", "enable_each_rank_log", "venv_script", "log_level")
UNSUPPORTED = ("module", "no_python", "no_local_rank")  # mlautotune launches the script through its probe module


def overrides(argv: List[str]) -> List[str]:
    """The `mlautotune` arguments for a DeepSpeed launcher command line."""
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
    from deepspeed.launcher.constants import PDSH_LAUNCHER
    from deepspeed.launcher.runner import DLTS_HOSTFILE, parse_args

    args = parse_launcher_args(parse_args, argv)
    for name in UNSUPPORTED:
        if getattr(args, name):
            raise UserError(f"--{name} is not supported by mlautotune-deepspeed: every experiment runs the script through mlautotune's measuring probe.", "Pass a Python training script without --module/--no_python/--no_local_rank.")
    config = next((v for flag in DEEPSPEED_CONFIG_FLAGS if (v := get_flag(args.user_args, flag)) and not v.startswith("-")), None)
    if config is None:
        raise UserError("The script's arguments name no ds_config.", f"Pass it as the script's --deepspeed ds.json (or --deepspeed_config), e.g. mlautotune-deepspeed --num_gpus 2 {args.user_script} --deepspeed ds.json.")
    out = [f"config={hydra_quote(config)}", f"script={hydra_quote(args.user_script)}", f"script_args={hydra_quote(shlex.join(args.user_args))}"]
    if args.autotuning == "run":
        out.append("mode=run")
    for key, value, unset in (("num_gpus", args.num_gpus, -1), ("num_nodes", args.num_nodes, -1), ("hostfile", args.hostfile, DLTS_HOSTFILE),
                              ("include", args.include, ""), ("exclude", args.exclude, ""), ("master_port", args.master_port, TORCH_DISTRIBUTED_DEFAULT_PORT),
                              ("launcher", args.launcher, PDSH_LAUNCHER)):
        if value != unset:
            out.append(f"launcher.{key}={hydra_quote(str(value)) if isinstance(value, str) else value}")
    extra = [f"--{name}" for name in SWITCHES if getattr(args, name, False)]
    for name in VALUED:
        value = getattr(args, name, None)
        if value not in (None, "", -1, "None", "info"):
            extra += [f"--{name}", str(value)]
    if extra:
        out.append("launcher.launcher_args=[" + ",".join(hydra_quote(x) for x in extra) + "]")
    return out


def parse_launcher_args(parse_args, argv: List[str]):
    """DeepSpeed's own parser; its complaint (argparse's usage block and error) becomes one paragraph."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(argv)
    except SystemExit as e:
        if not e.code:
            raise  # --help: argparse printed it
        said = next((line.split("error:", 1)[1].strip() for line in reversed(err.getvalue().splitlines()) if "error:" in line), err.getvalue().strip())
        if "user_script" in said and "required" in said:
            said = "no training script is given"
        raise UserError(f"mlautotune-deepspeed: {said}.",
                        "Write it as the DeepSpeed launcher's command line: mlautotune-deepspeed [--num_gpus N] [--hostfile F] [--autotuning tune|run] train.py --deepspeed ds.json [script args] (see mlautotune --help).")


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        translated = overrides(argv)
    except UserError as e:
        fail(e)
    mlautotune_main(translated)


if __name__ == "__main__":
    main()
