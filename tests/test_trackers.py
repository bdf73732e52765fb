"""log.trackers: a short run logs every metric, with the iteration as the step, the resolved config
and the collapse monitor's warnings into each tracker's own local store, read back here through
each library's reader; a run killed and resumed leaves no iteration twice; a missing package fails
at once with the install hint.

The test extra installs wandb, mlflow and trackio: a tracker that is not installed fails these
tests (ModuleNotFoundError), it does not skip them."""

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

from vagen.config import ConfigError, load_config

WORKER = Path(__file__).parent / "kill_worker.py"
ALL = "log.trackers=[tensorboard,wandb,mlflow,trackio]"
# group_size=1: every group's reward std is 0, so the collapse monitor warns at every iteration and
# the warnings' path to each tracker is exercised on every run.
RUN = ["--config", "sokoban_text", "rollout.env_groups=4", "rollout.group_size=1", "rollout.max_new_tokens=8",
       "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false", ALL]


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """One trackio database for the session: trackio reads TRACKIO_DIR once, when it is imported."""
    import os

    path = tmp_path_factory.mktemp("trackio")
    before = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(path)
    yield path
    if before is None:
        del os.environ["TRACKIO_DIR"]
    else:
        os.environ["TRACKIO_DIR"] = before


def _env(tmp_path: Path, trackio_dir: Path) -> dict:
    """Offline and in temporary folders: wandb writes offline run files into the run directory,
    trackio its database into `trackio_dir`, mlflow its default store into the run directory."""
    env = child_env(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
                    WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
                    TRACKIO_DIR=str(trackio_dir))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "TRACKIO_PROJECT"):
        env.pop(name, None)
    return env


# kill_worker.py with a pause of 2 s before its SIGKILL: the trackers' writers (wandb's every 0.5 s
# here, trackio's every 0.5 s) have written what they were given, as in a run whose iterations take
# longer than that.
PAUSED_KILL = ("import os, runpy, sys, time\n"
               "kill = os.kill\n"
               "os.kill = lambda pid, sig: (time.sleep(2), kill(pid, sig))\n"
               f"sys.argv[0] = {str(WORKER)!r}\n"
               f"runpy.run_path({str(WORKER)!r}, run_name='__main__')")


def _train(tmp_path, trackio_dir, model_cache, name, *extra, kill=(), env=None):
    worker = ["-c", PAUSED_KILL] if kill else [str(WORKER)]
    cmd = [sys.executable, *worker, *kill, *RUN, f"train.run_dir={tmp_path / 'runs'}", f"train.run_name={name}",
           f"model.builtin_cache={model_cache}", *extra]
    return subprocess.run(cmd, env={**_env(tmp_path, trackio_dir), **(env or {})}, capture_output=True, text=True,
                          timeout=600)


def _jsonl(run: Path) -> dict[int, dict]:
    """metrics.jsonl: iteration -> (finite metrics, warnings)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics = {k: v for k, v in record.items() if k not in ("iteration", "time", "warnings") and v is not None}
        out[record["iteration"]] = (metrics, record["warnings"])
    return out


# -- readers: each tracker's own store, through its library --------------------------------------------
def _wandb_records(path: Path):
    """The records of a wandb run file (.wandb), decoded with wandb's own protobuf classes.

    wandb 0.31 has no public reader for offline runs (wandb issues #1308, #1768): the file is a
    LevelDB-style log, 32 KiB blocks of records each with a 7-byte header (checksum, length, type: 1
    full, 2 first, 3 middle, 4 last), after a 7-byte file header ":W&B", 0xBEE1, version 0."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), f"{path}: not a wandb run file: {data[:7]!r}"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        else:
            raise AssertionError(f"{path}: record type {kind} at byte {pos}")
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_wandb(run: Path):
    """(step, metrics) in logged order, config, alerts over every offline run file of the run (a
    resumed run writes one more, which `wandb sync` merges into the same run)."""
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no wandb offline run files under {run / 'wandb'}"
    rows, config, alerts, ids = [], {}, [], set()
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
            elif kind == "alert":
                alerts.append((record.alert.title, record.alert.text))
    assert len(ids) == 1, f"the run's files name several wandb runs: {ids}"
    return rows, config, alerts


def read_mlflow(run: Path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]["id"]
    data = client.get_run(run_id).data
    by_step: dict[int, dict] = {}
    counts: dict[tuple, int] = {}
    for key in data.metrics:
        for m in client.get_metric_history(run_id, key):
            by_step.setdefault(m.step, {})[key] = m.value
            counts[(key, m.step)] = counts.get((key, m.step), 0) + 1
    twice = sorted(k for k, n in counts.items() if n > 1)
    assert not twice, f"mlflow holds these (metric, step) more than once: {twice[:5]}"
    alerts = {}
    for item in client.list_artifacts(run_id, "collapse_monitor"):
        text = Path(client.download_artifacts(run_id, item.path, str(run / "downloaded"))).read_text()
        alerts[int(item.path.rsplit("_", 1)[1].removesuffix(".txt"))] = text
    return sorted(by_step.items()), data.params, alerts


def read_trackio(run: Path, trackio_dir: Path):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    assert Path(trackio.utils.TRACKIO_DIR) == trackio_dir, "trackio was imported before the test set TRACKIO_DIR"
    logs = SQLiteStorage.get_logs("vagen", run.name)
    rows = [(row["step"], {k: v for k, v in row.items() if "/" in k}) for row in logs]
    (tracked,) = [r for r in trackio.Api().runs("vagen") if r.name == run.name]
    alerts = sorted((a["step"], a["text"]) for a in tracked.alerts())
    return rows, tracked.config, alerts


def read_tensorboard(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    by_step: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in by_step.get(event.step, {}), f"tensorboard holds {tag} at step {event.step} twice"
            by_step.setdefault(event.step, {})[tag] = event.value
    texts = {e.step for tag in events.Tags()["tensors"] if tag.startswith("collapse_monitor") for e in events.Tensors(tag)}
    return sorted(by_step.items()), texts


def _check_rows(tracker, rows, expected, exact=True):
    """Each iteration once, in order, with every finite metric of metrics.jsonl under its own name."""
    steps = [step for step, _ in rows]
    assert steps == sorted(expected), f"{tracker}: steps {steps}, expected each of {sorted(expected)} once"
    for step, metrics in rows:
        want = expected[step][0]
        assert set(metrics) == set(want), f"{tracker} step {step}: {set(metrics) ^ set(want)} differ"
        for key, value in want.items():
            if exact or not key.startswith("timing/"):
                assert math.isclose(metrics[key], value, rel_tol=1e-6, abs_tol=1e-7), f"{tracker} {key}@{step}"


def test_a_run_logs_every_metric_config_and_warning_to_each_tracker(tmp_path, trackio_dir, model_cache):
    done = _train(tmp_path, trackio_dir, model_cache, "two", "train.iterations=2")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "two"
    expected = _jsonl(run)
    assert sorted(expected) == [0, 1] and all(warnings for _, warnings in expected.values()), expected
    warnings = {it: "\n".join(w) for it, (_, w) in expected.items()}

    rows, config, alerts = read_wandb(run)
    _check_rows("wandb", rows, expected)
    assert config["train"]["iterations"] == 2 and config["log"]["trackers"] == ["tensorboard", "wandb", "mlflow",
                                                                                "trackio"]
    assert sorted(alerts) == [(f"collapse monitor, iteration {it}", warnings[it]) for it in (0, 1)]

    rows, params, alerts = read_mlflow(run)
    _check_rows("mlflow", rows, expected)
    assert params["train.iterations"] == "2" and params["rollout.group_size"] == "1"
    assert alerts == warnings

    rows, config, alerts = read_trackio(run, trackio_dir)
    _check_rows("trackio", rows, expected)
    assert config["train"]["iterations"] == 2 and config["rollout"]["group_size"] == 1
    assert alerts == sorted(warnings.items())

    rows, texts = read_tensorboard(run)
    _check_rows("tensorboard", rows, expected)
    assert texts == {0, 1}


def test_a_killed_run_resumes_its_tracker_runs_without_duplicated_steps(tmp_path, trackio_dir, model_cache):
    args = ("train.iterations=4", "train.save_every=2")
    # Killed in the update of iteration 3: iterations 0-2 are logged everywhere, the last checkpoint is
    # step_2 (after iteration 1), so the resumed run plays iteration 2 again. wandb writes its run file
    # every 15 s by default (what a SIGKILL loses; see vagen.trackers): here every 0.5 s, within the
    # 2 s the kill waits.
    flush = {"WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.5"}
    killed = _train(tmp_path, trackio_dir, model_cache, "resumed", *args, kill=["--kill-in-update", "3"], env=flush)
    assert killed.returncode == -9, killed.stderr[-3000:]
    run = tmp_path / "runs" / "resumed"
    assert (run / "checkpoints" / "latest").read_text() == "step_2"
    ledger = json.loads((run / "trackers.json").read_text())
    assert {name: entry["last_step"] for name, entry in ledger.items()} == {"wandb": 2, "mlflow": 2, "trackio": 2}
    resumed = _train(tmp_path, trackio_dir, model_cache, "resumed", *args, "train.resume=auto", env=flush)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "at iteration 2" in resumed.stdout, resumed.stdout[-2000:]
    assert json.loads((run / "trackers.json").read_text()) == {name: {**entry, "last_step": 3}
                                                               for name, entry in ledger.items()}
    expected = _jsonl(run)
    assert sorted(expected) == [0, 1, 2, 3]
    # The trackers that cannot delete keep the killed run's iteration 1, which equals the resumed run's
    # but for the wall-clock timings; tensorboard replaced it.
    assert len(list(run.glob("wandb/offline-run-*/run-*.wandb"))) == 2
    rows, _, alerts = read_wandb(run)
    _check_rows("wandb", rows, expected, exact=False)
    assert sorted(alerts) == [(f"collapse monitor, iteration {it}", "\n".join(expected[it][1])) for it in range(4)]
    rows, _, alerts = read_mlflow(run)
    _check_rows("mlflow", rows, expected, exact=False)
    assert sorted(alerts) == [0, 1, 2, 3]
    rows, _, alerts = read_trackio(run, trackio_dir)
    _check_rows("trackio", rows, expected, exact=False)
    assert [step for step, _ in alerts] == [0, 1, 2, 3]
    _check_rows("tensorboard", read_tensorboard(run)[0], expected)


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio"])
def test_a_missing_tracker_package_fails_at_once_with_the_install_hint(tracker, tmp_path, trackio_dir):
    # sys.modules[name] = None is how Python marks a module as not importable: find_spec returns None.
    script = (f"import sys, time; t0 = time.perf_counter(); sys.modules[{tracker!r}] = None\n"
              f"from vagen.train import main\n"
              f"code = main(['--config', 'sokoban_text', 'log.trackers=[tensorboard,{tracker}]', "
              f"'train.run_dir={tmp_path / 'runs'}'])\n"
              f"print(f'elapsed {{time.perf_counter() - t0:.3f}}'); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path, trackio_dir), capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f'pip install -e ".[{tracker}]"' in done.stderr and f"{tracker} needs the package {tracker}, which is not installed" in done.stderr
    elapsed = float(done.stdout.split("elapsed ")[1])
    assert elapsed < 1.0, f"the error took {elapsed:.2f} s"
    assert not (tmp_path / "runs").exists(), "work started before the check"


def test_an_unknown_tracker_names_the_closest_and_the_choices():
    with pytest.raises(ConfigError, match=r"'wandbb' is not a tracker; did you mean 'wandb'\? choices: tensorboard, "
                                          r"wandb, mlflow, trackio"):
        load_config("sokoban_text", ["log.trackers=[tensorboard,wandbb]"])
    with pytest.raises(ConfigError, match="names a tracker twice"):
        load_config("sokoban_text", ["log.trackers=[wandb,wandb]"])
    assert load_config("sokoban_text").log.trackers == ["tensorboard"]
