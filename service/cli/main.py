"""`python -m service COMMAND ...`: a thin dispatcher.

Each command lives in `service/cli/<command>.py` with `add_arguments(parser)` and `run(args) -> int`,
and is imported only when called, so `plan` and `estimate` never import torch, ray or deepspeed.
Bad input (`SpecError`) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from service.spec.errors import SpecError

COMMANDS = {
    "plan": ("plan", "Rank every valid parallel plan for an experiment and select one under its budget."),
    "estimate": ("estimate", "Memory, step time, tokens/s and MFU of one plan."),
    "proxy-run": (
        "proxy_run",
        "Run one plan for real at proxy scale on Ray (DeepSpeed workers) and measure it.",
    ),
    "search": ("search", "Search plans on proxies with Ray Tune, pruned by the model, recorded to MLflow."),
    "run": ("run", "The main job: plan, validate on proxies, calibrate, select, write the memo and configs."),
    "report": ("report", "Rebuild a finished run's design memo from its folder or MLflow run id."),
    "calibrate": (
        "calibrate",
        "Fit the cost model's parameters on measured runs; error per held-out source.",
    ),
    "mlflow-server": (
        "mlflow_server",
        "Serve MLflow (store + proxied artifacts) on 127.0.0.1 for drivers and the UI.",
    ),
    "submit": ("submit", "Submit a `python -m service ...` command to a Ray cluster's job API and wait."),
    "train": ("train", "The production run: the chosen plan at full scale on Ray Train, resumable, tracked."),
    "preflight": ("preflight", "Measure the plan on its cluster for a few steps; GO / NO-GO before the run."),
    "profile": (
        "profile",
        "Time this device's kernels over a model's shapes; write a profile and catalog entry.",
    ),
}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # argparse reads `-1e9`, `-inf` or `-.5e3` as an unknown option, so `--tokens-to-train -1e9` was
        # "expected one argument"; as values they reach the flag's type and validation, which name it.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.I)

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors follow the same contract: one line, exit 2.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _module(command: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"service.cli.{COMMANDS[command][0]}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m service", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # Only the command being run is imported (and only it gets its full argument list).
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            _module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(_module(args.command).run(args) or 0)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as err:
        if not _unwritable(err):
            raise
        # A file the command could not write or open (a full disk, a read-only or foreign folder, a
        # directory where a file goes): one line naming it, as bad input gets, not a traceback.
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2


def _unwritable(err: OSError) -> bool:
    """Whether `err` is a file the command could not write or open where the user pointed it."""
    import errno

    kinds = (FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
    full = err.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    return err.filename is not None and (isinstance(err, kinds) or full)


if __name__ == "__main__":
    raise SystemExit(main())
