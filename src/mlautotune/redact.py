"""Redaction: the one place that decides what is a secret. Everything that leaves the machine
(MLflow params, tags, artifacts, uploaded logs) passes through here.

Secrets are found three ways:
- by key name: a key whose words include token, password, passwd, secret, auth, credential(s),
  api_key/apikey/access_key/private_key (ZeRO knobs such as `reduce_bucket_size` are not keys of
  that kind: only whole words of the name count, and a lone `key` is not enough);
- by URL userinfo: `postgresql://user:pass@host/db` -> `postgresql://user:***@host/db`;
- in argument lists and text: `--hf_token xyz`, `--token=xyz`, `MLFLOW_TRACKING_PASSWORD=xyz`.
"""

import re
from typing import Any, List

MASK = "***"
_WORDS = {"token", "password", "passwd", "pwd", "secret", "auth", "authorization", "credential", "credentials", "apikey", "passphrase"}
_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("client", "secret")}
_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])")
# (Hydra writes overrides with `:` escaped: `postgresql\://user\:pass@host`)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*\\?://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
_USERONLY_TOKEN = re.compile(r"(?P<scheme>https?://)(?P<user>[^:/@\s]{20,})@")  # https://<token>@github.com
# KEY=value or KEY: value or --key value / --key=value, where KEY looks like a secret's name.
_ASSIGN = re.compile(
    r"(?P<key>--?[A-Za-z_][A-Za-z0-9_.\-]*(?=[=\s])|(?<![A-Za-z0-9_.\-])[A-Za-z_][A-Za-z0-9_.\-]*(?=['\"]?[=:]))"
    r"(?P<sep>['\"]?(?:=|:\s*)|\s+)(?P<q>['\"]?)(?P<value>[^\s'\"]+)"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]{8,}")


NOT_SECRET = ("PWD", "OLDPWD")  # the shell's working folders, not a password however "pwd" reads
_known: set = set()  # literal secret values seen in this process's inputs (masked wherever they appear)


def remember_secrets(*sources: Any) -> None:
    """Note the secret values inside these inputs (argument lists, URLs, ds_config dicts), so that a
    log printing them in any shape (`cmd = ['--hf_token', 'xyz']`) is masked too."""
    for src in sources:
        if isinstance(src, (list, tuple)):
            after_flag = False
            for a in src:
                a = str(a)
                if after_flag and len(a) >= 4:
                    _known.add(a)
                after_flag = a.startswith("-") and "=" not in a and secret_key(a)
                if a.startswith("-") and "=" in a and secret_key(a.partition("=")[0]) and len(a.partition("=")[2]) >= 4:
                    _known.add(a.partition("=")[2])
                remember_secrets(a) if "://" in a else None
        elif isinstance(src, dict):
            for k, v in src.items():
                if secret_key(str(k)) and isinstance(v, (str, int)) and len(str(v)) >= 4:
                    _known.add(str(v))
                elif isinstance(v, (dict, list, str)):
                    remember_secrets(v)
        elif isinstance(src, str):
            _known.update(m["pw"] for m in _USERINFO.finditer(src) if len(m["pw"]) >= 4)


def secret_key(key: str) -> bool:
    """True if a key's name marks its value as a secret (`comet.api_key`, `hf_token`, `MLFLOW_TRACKING_PASSWORD`)."""
    if str(key) in NOT_SECRET:
        return False
    words = [w for w in _SPLIT.split(str(key).replace(".", " ").strip("-")) if w]
    words = [w.lower() for w in " ".join(words).split()]
    if any(w in _WORDS for w in words):
        return True
    return any(p in _PAIRS for p in zip(words, words[1:])) or any(w.endswith(("token", "password", "secret")) for w in words)


def redact_text(text: str) -> str:
    """A free text (log, command line, URL) with URL passwords and `secret_name=value` values masked."""
    if not text:
        return text
    out = text
    for value in sorted(_known, key=len, reverse=True):
        out = out.replace(value, MASK)
    out = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", out)
    out = _USERONLY_TOKEN.sub(lambda m: f"{m['scheme']}{MASK}@", out)

    def assign(m: re.Match) -> str:
        if not secret_key(m["key"]) or m["value"] == MASK:
            return m.group(0)
        return f"{m['key']}{m['sep']}{m['q']}{MASK}"

    out = _BEARER.sub(lambda m: f"{m[1]} {MASK}", out)
    return _ASSIGN.sub(assign, out)


def redact_args(args: List[str]) -> List[str]:
    """An argument list with the value after a secret flag masked (`--hf_token X`, `--token=X`)."""
    out: List[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        if a.startswith("-") and "=" in a:
            flag, _, value = a.partition("=")
            out.append(f"{flag}={MASK}" if secret_key(flag) else f"{flag}={redact_text(value)}")
        elif a.startswith("-") and secret_key(a):
            out.append(a)
            hide_next = True
        else:
            out.append(redact_text(a))
    return out


def redact(value: Any, key: str = "") -> Any:
    """Any JSON-like value: dict values under secret keys masked, strings scrubbed, recursively."""
    if key and secret_key(key) and value not in (None, "", [], {}):
        return MASK
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
