"""Several tasks in one run (`rollout.tasks`): each task plays its own level groups under its own environment
config (env, prompt format, turns, tokens per turn, trajectory length), and the iteration's batch is the tasks'
episodes together, each tagged with its task.

Group ids stay within a task: on a rank, task t's groups are numbered after those of the tasks before it
(`offset` = the earlier tasks' groups per rank), so a group id names one level of one task, and the
reward-std filter (`vagen.update.filter_by_task`), GRPO's and GiGPO's groups and advantage whitening
(`vagen.update.whiten_by_task`) never mix tasks. Metrics of each task go under `rollout/<task>/...` beside
the totals (`task_metrics`).
"""

from __future__ import annotations

from vagen.config import task_configs
from vagen.episode import ChatEncoder, Episode
from vagen.rollout import Rollouts, graded_scores, make_envs, rollout_metrics

# Rollout metrics of the whole rollout (times, tokens) that a task's part adds to, not a mean of.
SUMMED = ("timing/generate", "timing/env", "rollout/generated_tokens", "rollout/carried_episodes")


class TaskRollouts:
    """A training run's rollouts over `rollout.tasks` on one rank: a `vagen.rollout.Rollouts` per task, each with
    the environments of its own config (`env.workers` processes or Ray actors per task), played one task after
    the other before each update. `play` has the interface of `Rollouts.play`."""

    def __init__(self, encoder: ChatEncoder, cfg, rank: int = 0, world_size: int = 1, start: int = 0,
                 owner: str | None = None):
        self.cfg, self.parts, self.pools = cfg, [], []
        for name, sub in task_configs(cfg):
            share = sub.rollout.env_groups // world_size
            envs = make_envs(sub.env, share * sub.rollout.group_size, owner=f"{owner}-{name}" if owner else None)
            self.pools.append(envs)
            self.parts.append((name, share, Rollouts(encoder, sub, envs, rank, world_size, start)))

    @property
    def envs(self):
        """The first task's environments (what reads a run's single-environment settings takes)."""
        return self.pools[0]

    def all_envs(self) -> list:
        """Every task's environments and worker pools, for `vagen.rollout.close_envs`."""
        return [env for pool in self.pools for env in (pool if isinstance(pool, list) else [pool])]

    def play(self, decoder, version: int, drain: bool = False) -> tuple[list[Episode], dict[str, float]]:
        """Each task's rollout in turn; its episodes' group ids shifted past the earlier tasks' groups and
        `task` set; the rollout's timing summed and each task's metrics under rollout/<task>/."""
        episodes, stats, offset = [], dict.fromkeys(SUMMED, 0.0), 0
        for name, share, source in self.parts:
            played, part = source.play(decoder, version, drain)
            for ep in played:
                ep.group_id += offset
                ep.task = name
            offset += share
            for key, value in part.items():
                stats[key] = stats.get(key, 0.0) + value if key in SUMMED else value
            envs = source.envs
            graded = graded_scores(envs[0] if isinstance(envs, list) else envs.example())
            stats.update(task_metrics(name, [ep for ep in played if ep.turns], graded))
            episodes += played
        return episodes, stats


def task_metrics(name: str, episodes: list[Episode], graded: tuple[str, ...] = ()) -> dict[str, float]:
    """`vagen.rollout.rollout_metrics` of one task's episodes, each key rollout/<name>/<metric>."""
    return {f"rollout/{name}/{key.removeprefix('rollout/')}": value
            for key, value in rollout_metrics(episodes, graded).items()}
