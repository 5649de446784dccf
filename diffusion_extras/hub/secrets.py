"""Secrets never reach disk, logs, cards or saved configs: the project's one secret-dropping rule,
used by the saved config (training), the model card and the Hub push (hub), and the trackers'
copy of the command line."""
from __future__ import annotations

import re
from collections.abc import Iterable

_HF_TOKEN_RE = re.compile(r"hf_[A-Za-z0-9]{30,}")  # shape of Hub user access tokens


def redact_config(config: dict, secrets: Iterable = ()) -> dict:
    """Copy of `config` without secrets: keys containing "token", values holding a known secret
    or shaped like a Hub token. Nested dicts and lists are cleaned the same way."""
    secrets = [s for s in secrets if s]

    def is_secret(value) -> bool:
        return isinstance(value, str) and (any(s in value for s in secrets) or bool(_HF_TOKEN_RE.search(value)))

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if "token" not in str(k).lower() and not is_secret(v)}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value if not is_secret(v)]
        return value

    return clean(config)



def redact_argv(argv: list, secrets: Iterable) -> None:
    """Trackers (wandb) record the command line: once parsed, every secret value is replaced in
    place, whatever flag spelling carried it."""
    for index, arg in enumerate(argv):
        for secret in secrets:
            if secret and secret in arg:
                argv[index] = arg = arg.replace(secret, "***")
