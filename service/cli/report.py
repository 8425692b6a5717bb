"""`python -m service report DIR_OR_RUN_ID [--out DIR]`

Rebuilds the design memo (Markdown and HTML, charts included) of a finished `run` from its
`result.json`: the run's folder, or its MLflow parent run id (the result is read from the run's
artifacts in the tracking store that MLFLOW_TRACKING_URI or the default sqlite store names).
Prints where the memo is. Exit 2 when neither a run folder nor a known run id is given.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from service.spec.errors import SpecError, validate_as

RESULT_FILE = "result.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="A run folder (holding result.json) or an MLflow parent run id.")
    parser.add_argument("--out", metavar="DIR", help="Where to write the memo (default: the run folder).")


def _from_mlflow(run_id: str) -> tuple[Path, Path]:
    """(the run's result.json downloaded, the temporary folder holding it)."""
    import logging
    import os

    # A fresh sqlite store logs its schema migration at INFO; a bad id must still be one line. MLflow
    # sets its logger's level from MLFLOW_LOGGING_LEVEL when imported, so the variable, not a level
    # set beforehand, is what holds (mlflow/utils/logging_utils.py).
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import mlflow

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient

    from service.spec.tracking import TrackingSpec
    from service.tracking.uri import resolve

    uri = resolve(TrackingSpec(), "default").uri
    try:
        MlflowClient(uri).get_run(run_id)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecError("source", f"{run_id} is neither a run folder nor a run in {uri}: {reason}") from None
    folder = Path(tempfile.mkdtemp(prefix="report-"))
    # Where the file lands under dst_path differs between MLflow versions: use the path it returns.
    local = mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path=f"run/{RESULT_FILE}", dst_path=str(folder), tracking_uri=uri
    )
    return Path(local), folder


def run(args: argparse.Namespace) -> int:
    from service.cli.args import output_path
    from service.report import write_memo
    from service.report.result import RunResult

    if args.out is not None:
        output_path("--out", args.out, folder=True)  # a file there, or no folder to put it in

    source = Path(args.source)
    download: Path | None = None
    if source.is_dir():
        path = source / RESULT_FILE
        if not path.is_file():
            raise SpecError("source", f"{source} holds no {RESULT_FILE}: is it a run folder?")
        out = Path(args.out or source)
    elif source.is_file():
        path, out = source, Path(args.out or source.parent)
    else:
        path, download = _from_mlflow(args.source)
        out = Path(args.out or Path.cwd() / f"report-{args.source}")
    if out.exists() and not out.is_dir():
        raise SpecError("--out", f"{out} is a file, not a folder")
    try:
        result = validate_as(RunResult, json.loads(Path(path).read_text()), str(path))
    except SpecError:
        raise
    except ValueError as err:
        raise SpecError("source", f"{path} is not a run result: {str(err).splitlines()[0]}") from None
    finally:
        if download is not None:  # the temporary download of an MLflow run's result
            shutil.rmtree(download, ignore_errors=True)
    if result.mlflow_run_id is None and not source.exists():
        result = result.model_copy(update={"mlflow_run_id": args.source})
    out.mkdir(parents=True, exist_ok=True)
    paths = write_memo(result, out)
    print(f"memo: {paths['html']} (and {paths['markdown']})")
    return 0
