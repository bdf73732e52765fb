"""Experiment trackers: where a run's metrics go besides `metrics.jsonl`.

`log.trackers` lists them (default `[tensorboard]`); all but tensorboard are optional packages:

    tensorboard  events in the run directory                      tensorboard --logdir runs
    wandb        Weights & Biases; with WANDB_MODE=offline the run    pip install -e ".[wandb]"
                 is written to runs/<run>/wandb/offline-run-*/ with
                 no network, uploaded later by `wandb sync`
    mlflow       MLflow; a SQLite store runs/<run>/mlflow.db (and     pip install -e ".[mlflow]"
                 runs/<run>/mlartifacts/) unless MLFLOW_TRACKING_URI
                 names another store
    trackio      Trackio's local database (TRACKIO_DIR, by default    pip install -e ".[trackio]"
                 ~/.cache/huggingface/trackio); `trackio show`

Each tracker gets the resolved config as the run's config, every finite metric under its own name
with the iteration as the step, and the collapse monitor's warnings: tensorboard as text, wandb and
trackio as alerts, mlflow as text artifacts `collapse_monitor/iteration_N.txt`. Only rank 0 logs.
Project and experiment: `vagen` unless WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME or TRACKIO_PROJECT say
otherwise; the tracker run is named after the run directory and grouped by config name.

Resuming (`train.resume`) continues the same tracker runs: their ids are kept in
runs/<run>/trackers.json. A killed run may have logged iterations past its last checkpoint, which
the resumed run plays again. TensorBoard drops those events (purge_step) and takes the new ones;
wandb, mlflow and trackio cannot delete logged points (wandb offline appends a second run file that
`wandb sync` merges into the same run; mlflow and trackio append to the metric's history), so the
resumed run skips the iterations such a tracker already holds, as trackers.json records them after
each log call. A resumed run replays those iterations exactly (tests/test_resume.py), so what the
tracker keeps is what the resumed run computes, wall-clock `timing/*` aside.

What a kill loses: mlflow writes each batch before `log` returns; trackio writes its queue every
0.5 s and wandb its run file every 15 s (WANDB__TRANSACTION_LOG_FLUSH_INTERVAL sets it), so a
SIGKILL (or a SIGTERM, which Python does not turn into an exit) loses the last iterations logged
within that window from those two, and the resumed run leaves them out rather than risk logging
them twice. A run that ends normally, by an exception or by Ctrl-C finishes its tracker runs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
# The modules each tracker imports; the pip extra of the tracker's name installs them.
MODULES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",), "trackio": ("trackio",)}
# mlflow's database stores (by default a SQLite file in the run directory) need these too; mlflow-skinny
# lacks them.
SQL_STORE = ("sqlalchemy", "alembic")
LEDGER = "trackers.json"
PROJECT = "vagen"


def missing_packages_error(names) -> str | None:
    """The error for the trackers in `names` whose package is not installed, None when all are.
    Looks the packages up without importing them, so a mistake is reported in well under a second."""
    missing, modules = [], []
    for name in names:
        wanted = MODULES[name]
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if name == "mlflow" and (not uri or uri.startswith(("sqlite", "postgresql", "mysql", "mssql"))):
            wanted += SQL_STORE
        absent = [module for module in wanted if importlib.util.find_spec(module) is None]
        if absent:
            missing.append(name)
            modules += absent
    if not missing:
        return None
    extras = ",".join(name for name in missing if name != "tensorboard")
    hint = f'pip install -e ".[{extras}]" (or pip install {" ".join(modules)})'
    need = "needs" if len(missing) == 1 else "need"
    if len(modules) == 1:
        what = f"the package {modules[0]}, which is not installed; install it"
    else:
        what = f"the packages {', '.join(modules)}, which are not installed; install them"
    return (f"log.trackers={list(names)}: {' and '.join(missing)} {need} {what} with {hint}, or leave "
            f"{' and '.join(missing)} out of log.trackers")


def _finite(stats: dict[str, float]) -> dict[str, float]:
    """Non-finite values are left out (metrics.jsonl records them as null)."""
    return {key: float(value) for key, value in stats.items() if math.isfinite(value)}


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


class TensorBoard:
    """Scalars and the collapse monitor's warnings (as text) in the run directory."""

    def __init__(self, run_dir: Path, first: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the events a killed run wrote after its last checkpoint
        self.writer = SummaryWriter(str(run_dir), purge_step=first)

    def state(self) -> dict:
        return {}

    def log(self, step: int, metrics: dict[str, float], warnings: list[str]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if warnings:
            self.writer.add_text("collapse_monitor", "\n\n".join(warnings), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """A Weights & Biases run; WANDB_MODE (online, offline, disabled) is wandb's own setting."""

    def __init__(self, run_dir: Path, name: str, group: str, config: dict, previous: dict | None):
        import wandb

        self.alert_level = wandb.AlertLevel.WARN
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, group=group,
                              id=previous["id"] if previous else None, resume="allow", dir=str(run_dir), config=config,
                              allow_val_change=True)  # a resumed run may extend train.iterations

    def state(self) -> dict:
        return {"id": self.run.id}

    def log(self, step: int, metrics: dict[str, float], warnings: list[str]) -> None:
        self.run.log(metrics, step=step, commit=True)  # with a step, wandb holds the row until the next one
        if warnings:
            self.run.alert(title=f"collapse monitor, iteration {step}", text="\n".join(warnings),
                           level=self.alert_level)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    """An MLflow run in MLFLOW_TRACKING_URI, or in a SQLite store in the run directory. (MLflow 3
    refuses a plain `mlruns/` file store unless MLFLOW_ALLOW_FILE_STORE=true: set both to use one.)"""

    def __init__(self, run_dir: Path, name: str, group: str, config: dict, previous: dict | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        if previous:
            self.run_id = previous["id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # artifacts beside the store when the store is ours, the server's default otherwise
            location = None if os.environ.get("MLFLOW_TRACKING_URI") else (run_dir.resolve() / "mlartifacts").as_uri()
            experiment_id = self.client.create_experiment(experiment_name, artifact_location=location)
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags={"config": group}).info.run_id
        params = [Param(key, value[:6000]) for key, value in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        import yaml

        self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def state(self) -> dict:
        return {"id": self.run_id}

    def log(self, step: int, metrics: dict[str, float], warnings: list[str]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])
        if warnings:
            self.client.log_text(self.run_id, "\n".join(warnings), f"collapse_monitor/iteration_{step}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio:
    """A Trackio run in its local database (TRACKIO_DIR), or wherever trackio's own settings send it."""

    def __init__(self, run_dir: Path, name: str, group: str, config: dict, previous: dict | None):
        import trackio

        self.alert_level = trackio.AlertLevel.WARN
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, group=group,
                                config=config, resume="allow" if previous else "never", embed=False)

    def state(self) -> dict:
        return {"name": self.run.name}

    def log(self, step: int, metrics: dict[str, float], warnings: list[str]) -> None:
        self.run.log(metrics, step=step)
        if warnings:
            self.run.alert(title=f"collapse monitor, iteration {step}", text="\n".join(warnings),
                           level=self.alert_level, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers of one run (rank 0 only): `log` each iteration, `close` at the end."""

    def __init__(self, names, run_dir: Path, config: dict, group: str, first: int | None):
        """`first`: the iteration a resumed run starts at (None for a new run)."""
        problem = missing_packages_error(names)
        if problem:
            raise ModuleNotFoundError(problem)
        self.run_dir = Path(run_dir)
        ledger = self.run_dir / LEDGER
        # A new run starts new tracker runs, even in the directory of an earlier one (train.run_name).
        self.ledger = json.loads(ledger.read_text()) if first is not None and ledger.exists() else {}
        self.trackers = {}
        for name in names:
            previous = self.ledger.get(name)
            if name == "tensorboard":
                self.trackers[name] = TensorBoard(self.run_dir, first)
                continue
            kind = {"wandb": Wandb, "mlflow": Mlflow, "trackio": Trackio}[name]
            self.trackers[name] = kind(self.run_dir, self.run_dir.name, group, config, previous)
            # Iterations the tracker holds already (logged by a killed run after its last checkpoint)
            # are not logged again; see the module docstring.
            last = previous.get("last_step", -1) if previous else -1
            self.ledger[name] = {**self.trackers[name].state(), "last_step": last}
        self._write_ledger()

    def log(self, step: int, stats: dict[str, float], warnings: list[str]) -> None:
        metrics = _finite(stats)
        for name, tracker in self.trackers.items():
            if name in self.ledger and step <= self.ledger[name]["last_step"]:
                continue
            tracker.log(step, metrics, warnings)
            if name in self.ledger:
                self.ledger[name]["last_step"] = step
                self._write_ledger()

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()

    def _write_ledger(self) -> None:
        path = self.run_dir / LEDGER
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.ledger, indent=1))
        os.replace(tmp, path)
