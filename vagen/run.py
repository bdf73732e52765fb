"""The run directory: resolved config, metrics (JSON lines and vagen.trackers), progress bar,
checkpoints with a pointer to the latest, resuming, and periodic evaluation.

    runs/<config>-<time>/
        config.yaml                 the resolved config (reproduce with --config runs/.../config.yaml)
        metrics.jsonl               one JSON object per iteration (slash-named metrics, warnings)
        events.out.tfevents.*       tensorboard (log.trackers: see vagen.trackers for wandb/, mlflow.db, trackio)
        trackers.json               the tracker runs' ids and last logged iterations, for resuming
        checkpoints/step_N/actor/   Hugging Face format (model + processor), loadable with from_pretrained;
                                    with LoRA the adapter in peft format (PeftModel.from_pretrained; merged
                                    into a whole checkpoint by python -m vagen.merge) + processor
        checkpoints/step_N/critic/  critic backbone + value head
        checkpoints/step_N/deepspeed/  engine states (optimizer, scheduler) for resuming
        checkpoints/step_N/universal/  while a run resumes on another rank count under ZeRO 1-3: the engine
                                    states in DeepSpeed's universal form (to_universal), removed once loaded
        checkpoints/step_N/trainer_state.json
        checkpoints/latest          name of the newest complete checkpoint
        eval/step_N/                evaluation results and episode videos
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vagen.config import Config, to_yaml
from vagen.distributed import Dist, barrier, broadcast_object, gather_objects

# Metrics that are counts per rank: summed over ranks instead of averaged.
# Filter metrics are computed over all ranks at once (vagen.batch_plan.filter_groups): averaged, not summed.
SUMMED_METRICS = ("rollout/truncated_trajectories", "rollout/generated_tokens", "update/tokens",
                  "rollout/env_errors")


def reduce_metrics(stats: dict[str, float], dist: Dist) -> dict[str, float]:
    """Average metrics over ranks (sum the counts); keys missing on a rank are averaged over the rest."""
    if not dist.active:
        return dict(stats)
    gathered = gather_objects(stats)
    out = {}
    for key in sorted({k for g in gathered for k in g}):
        values = [float(g[key]) for g in gathered if key in g]
        summed = key in SUMMED_METRICS or key.startswith("rollout/") and f"rollout/{key.rsplit('/', 1)[-1]}" in \
            SUMMED_METRICS  # a task's counts too (rollout/<task>/env_errors)
        out[key] = sum(values) if summed else sum(values) / len(values)
    return out


class RunDir:
    def __init__(self, path: Path, dist: Dist):
        self.path = path
        self.dist = dist
        self.is_main = dist.rank == 0
        self.t0 = time.time()
        self.trackers = None  # vagen.trackers.Trackers on rank 0
        self.resume_from: Path | None = None
        # The engine states are loaded from the checkpoint's universal/ form (saved on another rank count
        # under ZeRO 1-3): the engines are made with DeepSpeed's `checkpoint.load_universal`.
        self.universal = False

    # -- creation and resuming ------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: Config, dist: Dist) -> RunDir:
        """A new run directory, or the one being resumed (`train.resume=auto|PATH`). A checkpoint whose
        engine states cannot be loaded on this many ranks stops every rank here, before any work."""
        resume_from = None
        path = None
        first = None
        refusal = None
        universal = False
        if dist.rank == 0:
            try:
                resume_from = find_checkpoint(cfg)
                if resume_from is not None:
                    universal = check_resume_layout(resume_from, cfg, dist.world_size)
                if universal:  # the other ranks wait in the broadcast below (train.dist_timeout_minutes)
                    check_conversion_time(resume_from, cfg, dist.world_size)
                    to_universal(resume_from, cfg, dist.world_size)
            except ResumeError as err:
                refusal = str(err)
            if refusal is None and resume_from is not None:
                path = resume_from.parent.parent
                first = json.loads((resume_from / "trainer_state.json").read_text())["iteration"] + 1
                forget_after(path, first)
            elif refusal is None:
                name = cfg.train.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
                path = Path(cfg.train.run_dir) / name
                refusal = reused_run_name(path, cfg)
            if refusal is None and resume_from is None:
                path.mkdir(parents=True, exist_ok=cfg.train.run_name is not None)
                if cfg.train.resume == "auto":  # a run killed before its first checkpoint starts over
                    forget_after(path, 0)
            if refusal is None:
                (path / "config.yaml").write_text(to_yaml(cfg))
        path, resume_from, refusal, universal = broadcast_object((path, resume_from, refusal, universal), dist)
        if refusal is not None:  # every rank says why it stops, then all stop together
            print(f"refused: {refusal}" if dist.rank == 0 else f"rank {dist.rank}: refused: {refusal}",
                  file=sys.stderr, flush=True)
            barrier(dist)
            raise SystemExit(2)
        run = cls(Path(path), dist)
        run.resume_from = resume_from
        run.universal = universal
        if run.is_main:  # a resumed run continues its tracker runs from `first`
            from vagen.trackers import Trackers

            names = [n for n in cfg.log.trackers if n != "tensorboard" or cfg.log.tensorboard]
            run.trackers = Trackers(names, run.path, cfg.to_dict(), cfg.name, first)
        return run

    def maybe_resume(self, cfg: Config, actor_engine, critic_engine, monitor, tracked: dict | None = None) -> int:
        """Load engine states, the collapse monitor's history and the states of `tracked` (name ->
        object with `load_state_dict`) from the checkpoint being resumed; return the first iteration to run."""
        if self.resume_from is None:
            return 0
        ckpt = self.resume_from
        states = ckpt / ("universal" if self.universal else "deepspeed")
        for name, engine in (("actor", actor_engine), ("critic", critic_engine)):
            if engine is not None:
                # frozen base weights (LoRA) are not in the engine states: they come from model.path
                load_path, _ = engine.load_checkpoint(str(states), tag=name, load_module_strict=not _has_frozen(engine))
                if load_path is None:
                    raise FileNotFoundError(f"no {name} engine state under {states}; the checkpoint is incomplete")
        if self.universal:  # loaded by every rank: the copy goes, and the checkpoint is its saved size again
            barrier(self.dist)
            if self.is_main:
                shutil.rmtree(states)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if "monitor" in state:
            monitor.load_state_dict(state["monitor"])
        for name, obj in (tracked or {}).items():
            if name in state:
                obj.load_state_dict(state[name])
        if self.is_main:
            print(f"resuming from {ckpt} at iteration {state['iteration'] + 1}", flush=True)
        return int(state["iteration"]) + 1

    def announce(self, cfg: Config, checkpoint: Path) -> None:
        """The first lines of a run: what it trains, with which config, and where it writes."""
        where = "" if str(checkpoint) == cfg.model.path else f" ({checkpoint})"
        print(f"checkpoint: {cfg.model.path}{where}", flush=True)
        print(f"config: {cfg.name} ({self.path / 'config.yaml'})", flush=True)
        print(f"run directory: {self.path}", flush=True)

    # -- logging ------------------------------------------------------------------------------------
    def log(self, it: int, stats: dict[str, float], warnings: list[str]) -> None:
        record = {"iteration": it, "time": round(time.time() - self.t0, 3)}
        record.update({k: (v if math.isfinite(v) else None) for k, v in sorted(stats.items())})
        record["warnings"] = warnings
        with open(self.path / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(it, stats, warnings)
        from tqdm import tqdm

        for warning in warnings:
            tqdm.write(f"[collapse monitor] iteration {it}: {warning}")  # above the progress bar, not through it

    # -- evaluation and checkpoints -----------------------------------------------------------------
    def maybe_evaluate(self, it: int, cfg: Config, model, encoder, decoder=None) -> dict[str, float]:
        """Every `eval.every` iterations, and at it = -1 (step 0: the starting checkpoint, before any update)
        with `eval.before_training`: held-out episodes (greedy unless eval.do_sample), a few videos under
        eval/step_N/videos; returns `eval/*` metrics for this iteration's record."""
        every = cfg.eval.every
        due = cfg.eval.before_training if it < 0 else every > 0 and (it + 1) % every == 0
        if not due:
            return {}
        from vagen.eval import evaluate_tasks

        # with rollout.tasks each task on its own held-out levels, into eval/step_N/<task>
        summary = evaluate_tasks(model, encoder, cfg, cfg.eval.episodes, self.path / "eval" / f"step_{it + 1}",
                                 videos=cfg.eval.videos, dist=self.dist, with_baselines=False,
                                 desc=f"eval step_{it + 1}" if cfg.log.progress and self.is_main else None,
                                 decoder=decoder)
        return {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}

    def maybe_save(self, it: int, cfg: Config, actor_engine, critic_engine, processor, monitor,
                   force: bool = False, tracked: dict | None = None) -> None:
        last = it + 1 == cfg.train.iterations and cfg.train.save_last
        every = cfg.train.save_every
        if not (force or last or (every > 0 and (it + 1) % every == 0)):
            return
        save_checkpoint(self.path / "checkpoints" / f"step_{it + 1}", it, actor_engine, critic_engine, processor,
                        self.dist, {"monitor": monitor.state_dict(),
                                    **{name: obj.state_dict() for name, obj in (tracked or {}).items()}},
                        keep=cfg.train.keep_checkpoints)

    def finish(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        if self.is_main:
            print(f"run directory: {self.path}", flush=True)
            latest = self.path / "checkpoints" / "latest"
            actor = self.path / "checkpoints" / latest.read_text().strip() / "actor" if latest.exists() else None
            if actor is not None and (actor / "adapter_config.json").exists():  # LoRA: evaluated once merged
                print(f"merge it: python -m vagen.merge {actor} {self.path / 'merged'}", flush=True)
                print(f"evaluate it: {eval_command(self.path, self.path / 'merged')}", flush=True)
            else:
                print(f"evaluate it: {eval_command(self.path)}", flush=True)


def eval_command(run_dir: Path, checkpoint: Path | None = None) -> str:
    """The command that evaluates `checkpoint` (default: the latest checkpoint of `run_dir`) with the run's
    own config."""
    return (f"python -m vagen.eval --config {run_dir / 'config.yaml'} --checkpoint {checkpoint or run_dir} "
            f"--episodes 128")


def _full_state_dict(engine):
    """The module's full weights; under ZeRO-3 they are gathered from all ranks (collective)."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return None


def _has_frozen(engine) -> bool:
    """Whether the engine's module holds frozen parameters (a LoRA model's base weights), which its engine
    states leave out: they are model.path's, unchanged by training."""
    return any(not p.requires_grad for p in engine.module.parameters())


def forget_after(run_dir: Path, first: int) -> None:
    """Before a run resumes at iteration `first`: drop what a killed run left past its last complete
    checkpoint, the half-written checkpoints (`*.tmp`) and the metrics of iterations >= `first`, so that
    the resumed run's record equals an uninterrupted one's."""
    for stale in sorted((run_dir / "checkpoints").glob("*.tmp")):
        shutil.rmtree(stale)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line)["iteration"] < first]
        _write_atomically(metrics, "".join(kept))


def _write_atomically(path: Path, text: str) -> None:
    """`path` holds either its old text or all of `text`, whenever the process dies."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_checkpoint(out: Path, it: int, actor_engine, critic_engine, processor, dist: Dist,
                    trainer_state: dict | None = None, keep: int | None = None) -> None:
    """Every rank takes part (engine states are collective); rank 0 writes the HF-format files.

    Atomic: everything goes to `step_N.tmp/`, which becomes `step_N/` by a rename once complete, and
    only then does `checkpoints/latest` (replaced by a rename too) name it. A kill at any moment leaves
    the previous complete checkpoint in place and named by `latest`.

    With `keep`, only the newest `keep` checkpoints stay, and the disk never holds more than max(keep, 2)
    checkpoints, the one being written included: the oldest are removed before the write down to keep - 1
    (never the one `latest` names, so at keep 1 the previous checkpoint stays until the new one is complete),
    and the rest after it."""
    tmp = out.with_name(out.name + ".tmp")
    actor_state = _full_state_dict(actor_engine)
    critic_state = _full_state_dict(critic_engine) if critic_engine is not None else None
    if dist.rank == 0:
        if keep:
            prune_checkpoints(out.parent, keep - 1)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        actor_engine.module.save_pretrained(tmp / "actor", state_dict=actor_state)
        processor.save_pretrained(tmp / "actor")
        if critic_engine is not None:
            critic_engine.module.save(tmp / "critic", state_dict=critic_state)
    barrier(dist)  # the folder exists before any rank writes its engine states into it
    for name, engine in (("actor", actor_engine), ("critic", critic_engine)):
        if engine is not None:
            engine.save_checkpoint(str(tmp / "deepspeed"), tag=name, exclude_frozen_parameters=_has_frozen(engine))
    barrier(dist)  # every rank's states are written
    if dist.rank == 0:
        # the rank count and ZeRO stage decide where the engine states can be loaded (check_resume_layout)
        layout = {"ranks": dist.world_size, "zero_stage": actor_engine.zero_optimization_stage()}
        _write_atomically(tmp / "trainer_state.json",
                          json.dumps({"iteration": it, **layout, **(trainer_state or {})}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        _write_atomically(out.parent / "latest", out.name)
        if keep:
            prune_checkpoints(out.parent, keep)
    barrier(dist)


def prune_checkpoints(checkpoints: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints (`step_N`) under `checkpoints`, never the one
    `latest` names."""
    latest = checkpoints / "latest"
    named = latest.read_text().strip() if latest.exists() else None
    steps = sorted((p for p in checkpoints.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    for old in steps[:max(0, len(steps) - keep)]:
        if old.name != named:
            shutil.rmtree(old)


def reused_run_name(path: Path, cfg: Config) -> str | None:
    """Why a new run may not start in `path` (None: it may): `train.run_name` names a directory that holds a
    run already and `train.resume` is not set. Starting iteration 0 there would append a second run's rows to
    its metrics.jsonl, replace its config.yaml and leave its checkpoints/latest pointing at the old weights.
    An empty directory (made by the user) is taken."""
    if cfg.train.resume or cfg.train.run_name is None or not path.is_dir():
        return None
    held = sorted(entry.name for entry in path.iterdir())
    if not held:
        return None
    named = [name for name in ("metrics.jsonl", "config.yaml", "checkpoints") if name in held]
    others = len(held) - len(named)
    what = ", ".join(named + ([f"{others} other entr{'y' if others == 1 else 'ies'}"] if others else []))
    return (f"train.run_name={cfg.train.run_name!r}: {path} holds a run already ({what}), and train.resume is "
            f"not set, so this run would start at "
            f"iteration 0 inside it; give a new train.run_name for a new run, or train.resume=auto to continue that "
            f"one (from its latest checkpoint, or from the start if it saved none)")


class ResumeError(ValueError):
    """`train.resume` names a checkpoint this run cannot continue."""


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def find_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint directory `train.resume` points at, and a line on stdout saying which and why.

    `PATH`: a checkpoint directory, or a run directory's latest checkpoint. `auto` with `train.run_name`:
    the latest checkpoint of the run of that name, never another run's (none yet: a new run of that
    name). `auto` without it: the latest checkpoint of the newest run that this config named itself
    (`<config>-<date>-<time>`); runs given names of their own are left alone."""
    resume = cfg.train.resume
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume)
        if (path / "checkpoints" / "latest").exists():
            path = _latest(path)
        if not (path / "trainer_state.json").exists():
            there = "no such path" if not Path(resume).exists() else "no checkpoint there"
            raise ResumeError(
                f"train.resume={resume}: {there} (expected trainer_state.json in a runs/<run>/checkpoints/step_N "
                f"directory, or a run directory with checkpoints/latest); give the path of a checkpoint, "
                f"train.resume=auto to resume the run train.run_name names, or train.resume=null for a new run"
            )
        print(f"train.resume={resume}: resuming from checkpoint {path.name} ({path})", flush=True)
        return path
    root = Path(cfg.train.run_dir)
    if cfg.train.run_name is not None:
        run = root / cfg.train.run_name
        if (run / "checkpoints" / "latest").exists():
            ckpt = _latest(run)
            print(f"train.resume=auto: resuming run {run.name!r} (train.run_name) from its latest checkpoint "
                  f"{ckpt.name} ({ckpt})", flush=True)
            return ckpt
        why = "it has no complete checkpoint yet" if run.exists() else f"there is no run of that name under {root}"
        print(f"train.resume=auto: nothing to resume for train.run_name={run.name!r}: {why}; starting run "
              f"{run.name!r} from iteration 0", flush=True)
        return None
    named_by_config = re.compile(re.escape(cfg.name) + r"-\d{8}-\d{6}")
    candidates = sorted(
        (p for p in root.glob("*") if named_by_config.fullmatch(p.name) and (p / "checkpoints" / "latest").exists()),
        key=lambda p: (p / "checkpoints" / "latest").stat().st_mtime,
    )
    if not candidates:
        print(f"train.resume=auto: no run of config {cfg.name!r} ({cfg.name}-<date>-<time>) with a complete "
              f"checkpoint under {root}; starting a new run (set train.run_name to resume a run named "
              f"otherwise)", flush=True)
        return None
    run = candidates[-1]
    ckpt = _latest(run)
    others = f"; {len(candidates) - 1} older run(s) of this config left alone" if len(candidates) > 1 else ""
    print(f"train.resume=auto: no train.run_name, so resuming the run of config {cfg.name!r} whose checkpoint "
          f"is newest, {run.name!r}, from {ckpt.name} ({ckpt}){others}; set train.run_name=<run> to choose "
          f"the run", flush=True)
    return ckpt


def _stage_of(deepspeed_config: str) -> int:
    from vagen.config import CONFIGS_DIR

    return int(json.loads((CONFIGS_DIR / deepspeed_config).read_text()).get("zero_optimization", {})
               .get("stage", 0))


def saved_layout(ckpt: Path) -> tuple[int | None, int]:
    """(ranks, ZeRO stage) that the engine states of `ckpt` were saved with. Checkpoints record both in
    trainer_state.json; older ones are read from DeepSpeed's file names: one `*optim_states.pt` per rank
    under ZeRO 1-3 (read as 2 when stage 1 or 2), `zero_pp_rank_*_model_states.pt` under ZeRO-3, and
    under ZeRO-0 only `mp_rank_00_model_states.pt` (the rank count is then not recorded: None)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if "ranks" in state and "zero_stage" in state:
        return int(state["ranks"]), int(state["zero_stage"])
    names = [p.name for p in (ckpt / "deepspeed" / "actor").glob("*.pt")]
    optim = [n for n in names if n.endswith("optim_states.pt")]
    if not optim:
        return None, 0
    return len(optim), 3 if any(n.startswith("zero_pp_rank_") and n.endswith("model_states.pt") for n in names) else 2


def check_resume_layout(ckpt: Path, cfg: Config, world_size: int) -> bool:
    """Refuse a checkpoint whose engine states DeepSpeed cannot load with `train.deepspeed_config`; say on
    stdout when it resumes on another number of ranks. Returns whether its engine states must first be
    converted to DeepSpeed's universal form (`to_universal`).

    ZeRO-0 keeps the whole optimizer state in one file that every rank loads, so any rank count
    resumes it as saved. ZeRO 1-3 split the fp32 master weights and AdamW moments into one file per rank,
    which DeepSpeed loads only on the rank count that saved them; on another count they are converted to
    a universal checkpoint (one file per parameter and state, any rank count loads it). ZeRO 1 and 2 share
    a file layout, ZeRO-3 keeps the parameters partitioned as well: a stage of the other family is refused."""
    ranks, stage = saved_layout(ckpt)
    asked = _stage_of(cfg.train.deepspeed_config)
    family = {0: 0, 1: 1, 2: 1, 3: 3}
    if family.get(stage) != family.get(asked):
        raise ResumeError(
            f"train.resume: checkpoint {ckpt} holds ZeRO-{stage} engine states, and this run asks for ZeRO-{asked} "
            f"(train.deepspeed_config={cfg.train.deepspeed_config}), whose optimizer state is laid out otherwise; "
            f"resume with the DeepSpeed config it was saved with, or {_fresh_start(ckpt)}")
    if ranks is None or ranks == world_size:
        return False
    if stage == 0:
        print(f"train.resume: {ckpt.name} was saved on {ranks} rank(s) and resumes on {world_size}: ZeRO-0 keeps "
              f"the whole optimizer state on every rank, so it loads as saved (batches are shared out anew)",
              flush=True)
        return False
    print(f"train.resume: {ckpt.name} was saved on {ranks} rank(s) with ZeRO-{stage} and resumes on {world_size}: "
          f"its per-rank optimizer states are loaded through DeepSpeed's universal checkpoint "
          f"({ckpt / 'universal'}; batches are shared out anew)", flush=True)
    return True


# Bytes of engine states `to_universal` converts per second: 0.40 GB of ZeRO-3 states in 10.4 s on a 2-core CPU
# machine, the script's start-up included (benchmarks/bench_universal.py, docs/benchmarks.md). The slowest rate
# measured: an estimate that errs towards a longer wait.
CONVERSION_BYTES_PER_S = 40e6


def conversion_seconds(ckpt: Path) -> float:
    """How long `to_universal` would take on `ckpt`: its engine states' bytes (`deepspeed/`, every model) at
    CONVERSION_BYTES_PER_S."""
    size = sum(p.stat().st_size for p in (ckpt / "deepspeed").rglob("*") if p.is_file())
    return size / CONVERSION_BYTES_PER_S


def check_conversion_time(ckpt: Path, cfg: Config, world_size: int) -> None:
    """Refuse, before the other ranks wait, a conversion estimated to outlast `train.dist_timeout_minutes`, the
    longest the other ranks wait for rank 0 (one rank: nobody waits)."""
    if world_size <= 1:
        return
    minutes = conversion_seconds(ckpt) / 60
    if minutes > cfg.train.dist_timeout_minutes:
        size = minutes * 60 * CONVERSION_BYTES_PER_S
        raise ResumeError(
            f"train.resume: converting {ckpt.name}'s {size / 1e9:.1f} GB of engine states to a universal checkpoint "
            f"(it was saved on another number of ranks) is estimated at {minutes:.1f} minutes (at "
            f"{CONVERSION_BYTES_PER_S / 1e6:.0f} MB/s, the rate measured on a 2-core machine), longer than the "
            f"{world_size - 1} other rank(s) wait for it, train.dist_timeout_minutes={cfg.train.dist_timeout_minutes}; "
            f"set train.dist_timeout_minutes={max(2 * math.ceil(minutes), cfg.train.dist_timeout_minutes + 1)} for "
            f"this resume (it is only the longest wait), or resume on the rank count it was saved with")


def to_universal(ckpt: Path, cfg: Config, world_size: int, workers: tuple[int, int] | None = None) -> Path:
    """`ckpt/universal/<actor|critic>`: the engine states of `ckpt` in DeepSpeed's universal form (its
    `ds_to_universal` script, run in a process of its own, whose memory goes with it), which any rank count
    loads with the DeepSpeed config's `checkpoint.load_universal`. Written by rank 0 into `universal.tmp`,
    renamed when complete, and removed once every rank has loaded it (`RunDir.maybe_resume`): it is as large
    as the optimizer states. It takes about as long as reading and writing them once (minutes at 7B), while
    the other ranks wait for at most train.dist_timeout_minutes. `workers`: the script's processes that
    extract the ranks' partitions and merge each parameter's; DeepSpeed's defaults (4, 2) for a checkpoint
    of several ranks, (1, 1) for one of a single rank, whose one partition leaves nothing to share out."""
    if workers is None:
        workers = (4, 2) if (saved_layout(ckpt)[0] or 1) > 1 else (1, 1)
    out, tmp = ckpt / "universal", ckpt / "universal.tmp"
    if out.exists():  # complete (renamed once written): a resume stopped before every rank had loaded it
        print(f"train.resume: using the universal checkpoint converted before, {out}", flush=True)
        return out
    if tmp.exists():  # a conversion that was stopped
        shutil.rmtree(tmp)
    tmp.mkdir()
    t0 = time.perf_counter()
    waiting = (f" (the other {world_size - 1} rank(s) wait for it up to train.dist_timeout_minutes="
               f"{cfg.train.dist_timeout_minutes})" if world_size > 1 else "")
    print(f"train.resume: converting the engine states of {ckpt.name} to a universal checkpoint in {out}{waiting}",
          flush=True)
    for name in sorted(p.name for p in (ckpt / "deepspeed").iterdir() if p.is_dir()):  # actor, critic
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   str(ckpt / "deepspeed" / name), "--output_folder", str(tmp / name), "--inject_missing_state",
                   "--num_extract_workers", str(workers[0]), "--num_merge_workers", str(workers[1])]
        # on the CPU: it only reads and writes files, and leaves the rank's GPU to the run
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})
        if done.returncode != 0:
            raise ResumeError(
                f"train.resume: converting {ckpt / 'deepspeed' / name} to a universal checkpoint failed (exit "
                f"{done.returncode}), so it cannot resume on {world_size} rank(s); resume on the rank count it "
                f"was saved on, or {_fresh_start(ckpt)}. The conversion said:\n{(done.stdout + done.stderr)[-3000:]}")
    os.replace(tmp, out)
    print(f"train.resume: converted in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _fresh_start(ckpt: Path) -> str:
    """How to start a new run from the weights of `ckpt`, without its engine states."""
    actor = ckpt / "actor"
    if (actor / "adapter_config.json").exists():  # LoRA: the adapter is merged into a whole checkpoint first
        return (f"start a new run from its weights: python -m vagen.merge {actor} MERGED, then model.path=MERGED "
                f"train.resume=null (new adapters on the merged weights; the optimizer moments and learning-rate "
                f"schedule start afresh)")
    return (f"start a new run from its weights: model.path={actor} model.critic_path={ckpt / 'critic'} "
            f"train.resume=null (the optimizer moments and learning-rate schedule start afresh)")
