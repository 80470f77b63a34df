"""The `distrain` command (and `python -m distrain`): the jobs as its subcommands, for an installed distrain as
for a checkout, whose jobs/*.py call the same functions.

    distrain train [Hydra overrides]      distrain export | generate | plot [key=value ...]
    distrain prepare-data [overrides]     distrain cluster start | stop      distrain wheelhouse [options]

Each subcommand is a module here with `main(argv) -> int` (its exit status) and a docstring that is its
`--help`; the dispatcher imports only the one asked for, so `distrain plot` does not wait for torch or Ray."""

from __future__ import annotations

import difflib
import importlib
import sys

from distrain import __version__

# name → (module, one line for `distrain --help`), in the order a user meets them
COMMANDS = {
    "train": ("train", "train a model: Hydra overrides (--plan, --cfg job, -m for a sweep; --help lists them)"),
    "prepare-data": ("prepare_data", "text → token shards: data.path=… tokenizer=bpe data.shards=DIR"),
    "export": ("export", "a run's checkpoint as a Hugging Face model: run.name=NAME out=DIR"),
    "generate": ("generate", 'text from a run\'s checkpoint: run.name=NAME prompt="def "'),
    "plot": ("plot", "a run's curves as an image: run.name=NAME[,NAME...]"),
    "cluster": ("cluster", "a one-machine Ray head for `ray job submit`: start | stop"),
    "wheelhouse": ("wheelhouse", "a folder of wheels for nodes without internet (run in a checkout)"),
}
CALLED = {"as": None}  # "distrain" once the command dispatched; None when a checkout's jobs/*.py calls a job


def how(command: str) -> str:
    """How the user calls `command` here, for the lines that name a command: `distrain train`, or from a
    checkout's jobs/*.py, `python jobs/train.py` (the interpreter as it was given: `.venv/bin/python`)."""
    if CALLED["as"]:
        return f"{CALLED['as']} {command}"
    import os

    python = os.path.relpath(sys.executable)
    python = python if not python.startswith("..") else sys.executable
    return f"{python} jobs/{COMMANDS[command][0]}.py"


def helped(argv: list[str], doc: str | None) -> bool:
    """`-h` or `--help` as the first argument: the command's docstring printed (its --help), True."""
    if argv[:1] not in (["-h"], ["--help"]):
        return False
    print((doc or "").strip())
    return True


def overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {line}" for name, (_, line) in COMMANDS.items()]
    return "\n".join(
        [
            f"usage: distrain COMMAND [arguments]   (distrain {__version__}; python -m distrain is the same)",
            "",
            "Train deep-learning models across a Ray cluster with PyTorch's own parallelism building blocks.",
            "",
            "commands:",
            *lines,
            "",
            "distrain COMMAND --help: the command's arguments. distrain --version: the version.",
            "Presets of your own: distrain train --config-dir DIR model=mine (DIR/model/mine.yaml, beside ours).",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Dispatch `argv` (default sys.argv[1:]) to its subcommand; the subcommand's exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"distrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"distrain: error: no command {name!r}; {hint}`distrain --help` lists them", file=sys.stderr)
        return 2
    CALLED["as"] = "distrain"
    module = importlib.import_module(f"distrain.commands.{COMMANDS[name][0]}")
    sys.argv = [f"distrain {name}", *rest]
    return module.main(rest)


def script() -> None:
    """The `distrain` console script."""
    sys.exit(main())
