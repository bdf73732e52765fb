"""Several tasks in one run (`rollout.tasks`): each task plays its own level groups under its own environment
config (env, prompt format, turns, tokens per turn, trajectory length), and the iteration's batch is the tasks'
episodes together, each tagged with its task.

Group ids stay within a task: on a rank, task t's groups are numbered after those of the tasks before it
(`offset` = the earlier tasks' groups per rank), so a group id names one level of one task, and the
reward-std filter (`vagen.batch_plan.filter_by_task`), GRPO's and GiGPO's groups and advantage whitening
(`vagen.update.whiten_by_task`) never mix tasks. Metrics of each task go under `rollout/<task>/...` beside
the totals (`task_metrics`).

With `rollout.max_staleness = k > 0` each task admits its own groups (`vagen.staleness.Admission`, kept per task
in a checkpoint: `TaskAdmissions`) and its rollout ends once its share has ended whole; its unfinished episodes
wait in its own `Game` and go on after the update, so a group is always one task's.

With a decoder that has an agent loop (vLLM) every task's `Game` joins that one loop (`TaskRollouts.play`), so one
engine pass decodes turns of several tasks; each request keeps its own task's turn budget and its seed by row and
turn, so at rollout.max_staleness = 0 the episodes are those of the tasks played one after the other.
"""

from __future__ import annotations

from vagen.config import task_configs
from vagen.episode import ChatEncoder, Episode
from vagen.rollout import Rollouts, close_envs, make_envs, rollout_metrics
from vagen.staleness import Admission

# Rollout metrics of the whole rollout (times, tokens) that a task's part adds to, not a mean of.
SUMMED = ("timing/generate", "timing/env", "rollout/generated_tokens", "rollout/carried_episodes")


class TaskRollouts:
    """A training run's rollouts over `rollout.tasks` on one rank: a `vagen.rollout.Rollouts` per task, each with
    the environments of its own config (`env.workers` processes or Ray actors per task; (k + 1) x its share of
    episodes with rollout.max_staleness = k) and its own admission of groups (`admissions`, restored from a
    checkpoint when the run resumes), played before each update in one agent loop (vLLM) or one task after
    the other (hf). `play` has the interface of `Rollouts.play`."""

    def __init__(self, encoder: ChatEncoder, cfg, rank: int = 0, world_size: int = 1, start: int = 0,
                 owner: str | None = None, admissions: TaskAdmissions | None = None):
        self.cfg, self.parts, self.pools = cfg, [], []
        admissions = admissions or TaskAdmissions(cfg, world_size)
        tasks = task_configs(cfg)
        counts = [admissions.parts[name].in_flight_limit * sub.rollout.group_size for name, sub in tasks]
        self.ray = shared_ray([sub.env for _, sub in tasks], counts, owner)
        try:  # a task whose environments fail to start leaves no other task's workers (or Ray) behind
            for (name, sub), count in zip(tasks, counts):
                envs = make_envs(sub.env, count, owner=f"{owner}-{name}" if owner else None)
                self.pools.append(envs)
                self.parts.append((name, Rollouts(encoder, sub, envs, rank, world_size, start,
                                                  admissions.parts[name])))
        except BaseException:
            close_envs(self.all_envs())
            raise

    def graded(self) -> dict[str, tuple[str, ...]]:
        """Each task's graded fields (`vagen.rollout.graded_scores` of its prompt format), by task name, so that
        `rollout_metrics` scores each task's turns by its own format."""
        return {name: source.graded() for name, source in self.parts}

    def all_envs(self) -> list:
        """Every task's environments and worker pools, for `vagen.rollout.close_envs` (then the Ray instance
        they share, `shared_ray`)."""
        pools = [env for pool in self.pools for env in (pool if isinstance(pool, list) else [pool])]
        return pools + ([self.ray] if self.ray is not None else [])

    def play(self, decoder, version: int, saves_in: int = 0, together: bool = True
             ) -> tuple[list[Episode], dict[str, float]]:
        """Every task's rollout: with a decoder that has an agent loop (`rollout.backend=vllm`) and `together`,
        every task's game in that one loop, so that one engine pass decodes turns of several tasks (each
        task's requests still take its own turn budgets, and its game its own admission); otherwise each
        task's in turn (the hf backend's per-turn schedule). Each task's episodes' group ids shifted past the
        earlier tasks' groups and
        `task` set; the rollout's timing summed and each task's metrics under rollout/<task>/, over all its
        episodes (those whose environment failed at reset included: `env_errors` counts them). Raises
        RuntimeError, on every rank, naming the tasks whose environments failed in every episode of every
        rank."""
        if together and hasattr(decoder, "play"):
            games = [source.begin(version, saves_in) for _, source in self.parts]
            decoder.start_rollout()
            decoder.play(*games)
            results = [source.end() for _, source in self.parts]
        else:
            results = [source.play(decoder, version, saves_in) for _, source in self.parts]
        episodes, stats, offset = [], dict.fromkeys(SUMMED, 0.0), 0
        for (name, source), (played, part) in zip(self.parts, results):
            for ep in played:
                ep.group_id += offset
                ep.task = name
            offset += len(played) // source.cfg.rollout.group_size
            for key, value in part.items():
                stats[key] = stats.get(key, 0.0) + value if key in SUMMED else value
            stats.update(task_metrics(name, played, source.graded()))
            episodes += played
        refuse_failed_tasks([name for name, _ in self.parts], episodes)
        return episodes, stats


def refuse_failed_tasks(names: list[str], episodes: list[Episode]) -> None:
    """Raise RuntimeError naming each task of `names` that played episodes (over all ranks) of which none ran
    without an environment error: such a task trains nothing while its metrics read as a task that fails.
    Every rank calls it with its own episodes and raises alike."""
    import torch

    from vagen.distributed import all_reduce

    counts = torch.tensor([[sum(ep.task == name for ep in episodes),
                            sum(ep.task == name and ep.error is None for ep in episodes)] for name in names],
                          dtype=torch.float64)
    counts = all_reduce(counts)
    failed = [(name, int(played)) for name, (played, fine) in zip(names, counts.tolist()) if played and not fine]
    if failed:
        first = {name: next((ep.error for ep in episodes if ep.task == name and ep.error), None) for name, _ in failed}
        raise RuntimeError(
            "rollout.tasks: the environments of " + "; ".join(
                f"task {name} failed in all of its {played} episodes (on this rank: {first[name] or 'none played'})"
                for name, played in failed)
            + ". Fix that task's environment config (its env section: name, params, env.workers, env.backend), "
              "or drop the task from rollout.tasks")


def task_metrics(name: str, episodes: list[Episode], graded: tuple[str, ...] = ()) -> dict[str, float]:
    """`vagen.rollout.rollout_metrics` of one task's episodes, each key rollout/<name>/<metric>."""
    return {f"rollout/{name}/{key.removeprefix('rollout/')}": value
            for key, value in rollout_metrics(episodes, graded).items()}


class TaskAdmissions:
    """Each task's `vagen.staleness.Admission` of its share of level groups on a rank (`parts`, by task name),
    saved in a checkpoint together. A checkpoint without per-task counts (saved by a synchronous run before
    they were kept) restores none: each task then numbers its groups as the synchronous run does
    (`Admission.resume`)."""

    def __init__(self, cfg, world_size: int = 1):
        # each task's own groups; rollout.max_staleness is the run's (a task cannot set it)
        self.parts = {name: Admission(sub.rollout.env_groups // world_size, cfg.rollout.max_staleness)
                      for name, sub in task_configs(cfg)}

    def state_dict(self) -> dict:
        return {"tasks": {name: admission.state_dict() for name, admission in self.parts.items()}}

    def load_state_dict(self, state: dict) -> None:
        for name, counts in state.get("tasks", {}).items():
            if name in self.parts:
                self.parts[name].load_state_dict(counts)

    def load_ranks(self, states: list[dict]) -> None:
        """Each task's counts from a checkpoint of another number of ranks (`Admission.load_ranks`)."""
        for name, admission in self.parts.items():
            admission.load_ranks([state.get("tasks", {}).get(name, {}) for state in states])


def run_admission(cfg, world_size: int):
    """The admission of a run's level groups on a rank: one `Admission`, or with rollout.tasks each task's."""
    if cfg.rollout.tasks:
        return TaskAdmissions(cfg, world_size)
    return Admission.for_config(cfg, world_size)


def shared_ray(envs: list, counts: list[int], owner: str | None):
    """One Ray connection for the tasks whose environments are Ray actors (`vagen.env_ray.SharedRay`), made here
    when this process has none: the first pool would otherwise start (or join) Ray for its own actors only, and
    stop it when closed, under the others'. None when no task uses Ray, or Ray is connected already."""
    on_ray = [(env, count) for env, count in zip(envs, counts) if env.workers > 0 and env.backend == "ray"]
    if not on_ray:
        return None
    from vagen.env_ray import SharedRay  # Ray is an optional dependency

    return SharedRay.for_pools(on_ray, owner)
