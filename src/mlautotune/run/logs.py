"""An experiment's logs once it has ended: capped to their head and tail, and with known secrets masked.

The ranks write stdout.log and stderr.log directly (the files are their standard streams). A script
that floods its output until the timeout would leave hundreds of MB, kept on disk and uploaded to
MLflow: what is kept is the first and last LOG_KEEP_BYTES, with a line saying how much was cut
between them. Values known to be secrets (a token in the script's arguments, the tracking URI's
password, secret environment variables) are masked wherever the script or DeepSpeed printed them.
"""

from pathlib import Path

from mlautotune.files import atomic_write_text
from mlautotune.redact import redact_text

LOG_KEEP_BYTES = 2 * 2**20  # kept at each end of a log (4 MiB at most per log)


def settle(path: Path, keep: int = LOG_KEEP_BYTES) -> None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size <= 2 * keep:
                text = f.read().decode(errors="replace")
            else:
                head = f.read(keep).decode(errors="replace")
                f.seek(size - keep)
                tail = f.read().decode(errors="replace")
                text = (f"{head}\n[mlautotune: {size - 2 * keep:,} bytes of this log were cut here; the first and last "
                        f"{keep // 2**20} MiB of its {size:,} bytes are kept]\n{tail}")
    except OSError:
        return
    masked = redact_text(text)
    if size > 2 * keep or masked != text:
        atomic_write_text(path, masked)
