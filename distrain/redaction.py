"""Secrets kept out of what is recorded: `storage.options` may carry an object store's key, and a config is
written to the run's folder, W&B and the console; here, what such a record holds instead. Pure text."""

from __future__ import annotations

import re

# Option names that may carry a secret (s3fs's key/secret/token, adlfs's account_key and connection_string (it holds
# the account key), gcsfs's token...).
_SECRET = re.compile(r"key|secret|token|password|credential|sas|connection", re.IGNORECASE)


def redact(options: dict) -> dict:
    """`options` with every value whose name suggests a secret replaced, nested dicts included."""
    return {
        k: redact(v) if isinstance(v, dict) else ("<redacted>" if _SECRET.search(str(k)) else v)
        for k, v in options.items()
    }


def redact_override(override: str) -> str:
    """A command-line override as it may be recorded: `+storage.options.secret=...` with its value redacted."""
    key, eq, value = override.partition("=")
    name = key.lstrip("+")
    said = name if name.startswith("storage.options.") else value  # one option's name, or the whole dict
    if eq and name.startswith("storage.options") and _SECRET.search(said):
        return f"{key}=<redacted>"
    return override
