"""The `key=value` arguments of the one-process jobs (export, generate, plot) and how they end: what the
job did in one line, or a user error in one line and exit status 2. Torch-free, so jobs/plot.py starts fast."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable

from distrain.config import ConfigError
from distrain.urls import check_location

REQUIRED = object()  # a job argument without a default
Spec = dict[str, tuple[Callable[[str], object], object]]  # each argument's parser (its type) and default


class Location(str):
    """A job argument naming a folder or a URL (run.storage, out): checked as one, a URL never taken for a path."""


def boolean(text: str) -> bool:
    """true or false (bool('false') would be True)."""
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


def job_args(argv: list[str], spec: Spec, usage: str) -> dict:
    """A job's `key=value` arguments, each `spec[key] = (type, default)`; a one-line ConfigError for an
    unknown key (with the closest one), a value not of its type (a Location: not a well-formed URL though it
    starts like one), or a REQUIRED one missing."""
    args = {key: default for key, (_, default) in spec.items()}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in spec:
            close = meant(key, spec)
            hint = f"did you mean {close}=?" if close else f"usage: {usage}"
            raise ConfigError(f"{arg!r} is not an argument of this job; {hint}")
        kind = spec[key][0]
        try:
            args[key] = kind(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected {kind.__name__}; usage: {usage}") from None
        if kind is Location:
            try:
                check_location(value, key)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    missing = [key for key, value in args.items() if value is REQUIRED]
    if missing:
        raise ConfigError(f"{missing[0]}= is required; usage: {usage}")
    return args


def meant(given: str, known: Iterable[str]) -> str | None:
    """The one of `known` (arguments, runs) that a misspelt `given` names, or None when none is close."""
    return next(iter(difflib.get_close_matches(given, list(known), n=1)), None)


def run_job(argv: list[str], spec: Spec, usage: str, work: Callable[[dict], str]) -> None:
    """Parse `argv` by `spec`, run `work` on the arguments and print what it returns; a ConfigError from
    either is one line on stderr and exit status 2."""
    try:
        said = work(job_args(argv, spec, usage))
    except ConfigError as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(said)
