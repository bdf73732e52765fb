"""Evaluate a checkpoint on held-out level seeds, beside a random policy and the optimal solver.

    python -m vagen.eval --checkpoint runs/<run> [--episodes 128] [--videos 8] [--out DIR] [section.key=value ...]
    python -m vagen.eval --checkpoint runs/<run>/checkpoints/step_N ...
    deepspeed --num_gpus 2 vagen/eval.py --checkpoint runs/<run>   (episodes split across ranks)

    python -m vagen.eval --config sokoban_visual --checkpoint assets:sokoban_visual   (a shipped warm start)
    python -m vagen.eval --checkpoint runs/<run> --task frozenlake_visual   (one task of a run over several)
    python -m vagen.eval --config sokoban_visual --policy openai --base-url http://127.0.0.1:8000/v1 \
        --model NAME [--api-key-env OPENAI_API_KEY] [--seeds 0,1,2 | --seeds FILE]   (a served or API model)
    python -m vagen.eval --checkpoint runs/<run> --decoy-frames   (also success with another level's frames)

A checkpoint inside a run directory is evaluated with the run's own config (`runs/<run>/config.yaml`:
its tokens per turn, turns, dtype, environment), the settings it was trained with. `--config` replaces
it, with a warning naming what differs from the run's; a checkpoint outside a run (a shipped warm start,
a Hugging Face checkpoint directory) needs `--config`.

Writes `results.json` and a Markdown table `results.md` into the output directory (default:
`<checkpoint>/eval`, for a shipped warm start `<train.run_dir>/eval/NAME`), and episode videos
(mp4 + GIF) under `videos/`, and the episode browser `index.html` with its `frames/` (vagen.browse).
Seeds are the evaluation seeds (>= 1e9), disjoint from every training seed, unless `--seeds` lists the
levels (to play the episode set of another evaluation). Decoding is greedy unless `eval.do_sample=true`. For
a visual environment the results hold the frame gap (`vagen.frame_check`): how much likelier the episodes'
responses are with their own frames than with another episode's (a checkpoint's only); with
`--decoy-frames`, success when every observation shows another level's frames, beside success with its own.

`--policy openai` evaluates a model behind an OpenAI-compatible chat API instead of a checkpoint
(`vagen.api_policy`: messages, retries, model errors), on the config's environment and with its turns,
tokens per turn and frame sizes (the processor of the config's `model.path`); output default
`<train.run_dir>/eval/openai-MODEL`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

REFERENCE_POLICIES = ("random", "solver")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(records: list[dict]) -> dict:
    """Success rate with its 95% interval, mean return, turns, actions, format and validity rates. Records of a
    served model (`--policy openai`) carry `model_error`: episodes whose request failed on every try are left out
    of every rate (`episodes` counts the others) and counted in `model_errors`."""
    served = any("model_error" in r for r in records)
    errors = [r for r in records if r.get("model_error")]
    records = [r for r in records if not r.get("model_error")]
    n = len(records)

    def mean(key):
        return _mean_present([r.get(key) for r in records])

    successes = sum(bool(r["success"]) for r in records)
    low, high = wilson_interval(successes, n)
    return {
        "episodes": n,
        "success": successes / n if n else 0.0,
        "success_ci95": [low, high],
        "return": mean("return"),
        "turns": mean("turns"),
        "actions": mean("actions"),
        "format_ok": mean("format_ok"),
        "action_valid": mean("action_valid"),
        "response_length": mean("response_length"),
        # grades of the agent's <observation> / <prediction> against the true state (structured formats)
        "grounding_score": mean("grounding_score"),
        "worldmodel_score": mean("worldmodel_score"),
        **({"model_errors": len(errors)} if served else {}),
    }


def episode_record(seed: int, turns: list[dict], success: bool) -> dict:
    """Per-episode numbers from its turns' rewards and infos."""
    return {
        "seed": seed,
        "success": bool(success),
        "return": float(sum(t["reward"] for t in turns)),
        "turns": len(turns),
        "actions": sum(len(t["info"].get("actions", [])) for t in turns),
        "actions_per_turn": [len(t["info"].get("actions", [])) for t in turns],
        "format_ok": float(np.mean([bool(t["info"].get("format_ok")) for t in turns])) if turns else 0.0,
        "action_valid": float(np.mean([bool(t["info"].get("action_is_valid")) for t in turns])) if turns else 0.0,
        "response_length": float(np.mean([t["length"] for t in turns])) if turns and "length" in turns[0] else None,
        **{key: _mean_present([t["info"].get(key) for t in turns]) for key in ("grounding_score", "worldmodel_score")},
    }


def _mean_present(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def play_reference(cfg, seed: int, policy: str) -> dict | None:
    """One episode of a scripted policy on `seed` under the model's turn budget: `random` takes
    `max_actions_per_turn` valid actions drawn by the env's `random_actions`, `solver` follows the env's optimal
    plan, re-planned every turn. None where the env has no such policy."""
    from envs_visual.base import format_response
    from vagen.rollout import make_env

    env = make_env(cfg.env)
    if policy == "random" and env.random_actions(np.random.default_rng(0), 1) is None:
        return None
    if policy == "solver" and not hasattr(env, "solve"):
        return None
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    turns, success = [], False
    for _ in range(cfg.rollout.max_turns):
        if policy == "random":
            actions = env.random_actions(rng, env.max_actions_per_turn)
        else:
            actions = (env.solve() or [])[: env.max_actions_per_turn]
            if not actions:
                break
        _, reward, terminated, truncated, info = env.step(format_response(env.prompt_format, ", ".join(actions)))
        turns.append({"reward": reward, "info": info})
        success = bool(info.get("success"))
        if terminated or truncated:
            break
    if hasattr(env, "close"):
        env.close()
    return episode_record(seed, turns, success)


def _gather(items: list, dist) -> list:
    """Every rank's items, in rank order."""
    if dist is None or not dist.active:
        return items
    from vagen.distributed import gather_objects

    return [x for part in gather_objects(items) for x in part]


def evaluate(model, encoder, cfg, episodes: int, out_dir: Path, videos: int = 0, dist=None,
             with_baselines: bool = True, desc: str | None = None, decoder=None, seeds: list[int] | None = None,
             decoy_frames: bool = False) -> dict:
    """Play `episodes` held-out episodes (split across ranks), or the levels `seeds` when given, write results
    and videos, return the model's summary (and the reference rows under "reference"). `model` None: the
    decoder plays without one (a served model, `vagen.api_policy.APIDecoder`). A sampled evaluation
    (`eval.do_sample`) draws from `eval.sample_seed` + rank: the same checkpoint on the same number
    of ranks plays the same episodes, and the caller's random state is left as it was. With `desc`,
    a progress bar of that name counts this rank's episodes as they end. `decoder`: the engine to decode
    with (default: `rollout.backend` over `model`).

    A visual environment's summary holds the frame gap of the episodes when a model is evaluated
    (`vagen.frame_check.eval_frame_gap`: frame_gap, frame_gap_positive, frame_gap_turns); with `decoy_frames`
    the same levels are played again with each observation's frames from another evaluation level
    (`vagen.frame_check.DecoyFrames`), whose success is `decoy_frames` in results.json, a row of results.md
    and decoy_success[_ci95] in the summary."""
    from vagen.api_policy import APIDecoder
    from vagen.browse import episode_data, write_browser
    from vagen.console import progress_bar
    from vagen.decoding import own_draws
    from vagen.episode import eval_seeds
    from vagen.frame_check import eval_frame_gap
    from vagen.rollout import make_env, rollout

    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    explicit = seeds is not None
    seeds = list(seeds) if explicit else eval_seeds(episodes)
    served = isinstance(decoder, APIDecoder)  # a served model: episodes may end as model errors
    mine = seeds[rank::world]
    remote = cfg.env.backend == "http"  # episodes played in sessions on environment servers
    if remote:
        from vagen.rollout import make_envs

        envs, video_seeds = make_envs(cfg.env, len(mine)), set()  # the servers' frames stay on the servers
        if videos and (rank == 0):
            print("env.backend=http: no videos (the servers keep the frames a video draws); the episode browser "
                  "shows what the policy saw", flush=True)
    else:
        envs = [make_env(cfg.env) for _ in mine]
        video_seeds = set(seeds[:videos])
        for env, seed in zip(envs, mine):
            env.record_frames = seed in video_seeds
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    bar = progress_bar(len(mine), desc, "episode")
    with own_draws(cfg.eval.sample_seed + rank, dist.device if dist is not None else None):
        played, _ = rollout(model, encoder, cfg, mine, group_size=1, do_sample=cfg.eval.do_sample, envs=envs,
                            progress=bar, decoder=decoder, sample_seed=cfg.eval.sample_seed + rank)
    if bar is not None:
        bar.close()
    visual = cfg.env.render_mode == "vision"
    gap = eval_frame_gap(model, encoder, cfg, played, dist) if visual and model is not None else {}
    decoys = play_with_decoys(model, encoder, cfg, seeds, mine, decoder, dist) if decoy_frames else None
    if model is not None:
        model.train(was_training)
    records = [episode_record(ep.seed, [{"reward": t.reward, "info": t.info, "length": t.response_length}
                                        for t in ep.turns], ep.success) for ep in played]
    if served:
        for record, ep in zip(records, played):
            record["model_error"] = ep.model_error
            record["env_error"] = ep.error
            record["replies"] = decoder.replies_of(ep)  # uncut, with finish_reason ("length": the budget cut it)
    references = {}
    if with_baselines and not (remote and cfg.env.remote_config):  # a foreign server's env has no local twin
        for policy in REFERENCE_POLICIES:
            rows = [play_reference(cfg, seed, policy) for seed in mine]
            references[policy] = [r for r in rows if r is not None]
    out_dir = Path(out_dir)
    written = []
    for ep in played:
        if ep.seed in video_seeds:
            written += write_video(cfg, ep, out_dir / "videos")
    for env in envs if isinstance(envs, list) else [envs]:
        if hasattr(env, "close"):
            env.close()
    records = sorted(_gather(records, dist), key=lambda r: r["seed"])
    browsed = _gather(episode_data(played), dist)  # every rank's turns and frames, for the episode browser
    for policy in references:
        references[policy] = _gather(references[policy], dist)
    summary = {**summarize(records), **gap}
    decoy = None
    if decoys is not None:
        decoy = summarize(sorted(_gather(decoys, dist), key=lambda r: r["seed"]))
        summary.update(decoy_success=decoy["success"], decoy_success_ci95=decoy["success_ci95"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        reference_rows = {p: summarize(rows) for p, rows in references.items() if rows}
        result = {"env": cfg.env.name, "config": cfg.name, "seeds": [seeds[0], seeds[-1]],
                  "do_sample": cfg.eval.do_sample, "model": summary, "reference": reference_rows,
                  "episodes": records}
        if explicit:
            result["seed_list"] = seeds
        if served:
            result["policy"] = decoder.settings.describe()
        if decoy is not None:
            result["decoy_frames"] = decoy
        (out_dir / "results.json").write_text(json.dumps(result, indent=2))
        (out_dir / "results.md").write_text(results_table(cfg.env.name, summary, reference_rows, decoy))
        write_browser(out_dir, cfg, browsed)
    summary = dict(summary)
    summary["videos"] = len(written)
    return summary


def play_with_decoys(model, encoder, cfg, seeds: list[int], mine: list[int], decoder, dist=None) -> list[dict]:
    """This rank's levels `mine` played again, each observation showing the frames of another evaluation level
    (`vagen.frame_check.decoy_seeds` over all the evaluation's `seeds`); their episode records."""
    from vagen.decoding import own_draws
    from vagen.frame_check import DecoyFrames, decoy_seeds
    from vagen.rollout import make_env, rollout

    rank, device = (dist.rank, dist.device) if dist is not None else (0, None)
    decoy_of = decoy_seeds(seeds)
    envs = [DecoyFrames(make_env(cfg.env), make_env(cfg.env), decoy_of[seed]) for seed in mine]
    try:
        with own_draws(cfg.eval.sample_seed + rank, device):
            played, _ = rollout(model, encoder, cfg, mine, group_size=1, do_sample=cfg.eval.do_sample, envs=envs,
                                decoder=decoder, sample_seed=cfg.eval.sample_seed + rank)
    finally:
        for env in envs:
            env.close()
    return [episode_record(ep.seed, [{"reward": t.reward, "info": t.info, "length": t.response_length}
                                     for t in ep.turns], ep.success) for ep in played]


def evaluate_tasks(model, encoder, cfg, episodes: int, out_dir: Path, videos: int = 0, dist=None,
                   with_baselines: bool = True, desc: str | None = None, decoder=None,
                   tasks: list[str] | None = None, seeds: list[int] | None = None,
                   decoy_frames: bool = False) -> dict:
    """`evaluate` on each task of rollout.tasks (`tasks`: those named, default all), each on `episodes` of its own
    held-out levels under its own environment config, into `out_dir/<task>` (results, videos and episode browser
    of its own); `out_dir/results.md` and `results.json` hold every task's row. Returns the summary with each
    task's numbers under `<task>/...` and, over all its tasks' episodes, success, return and format_ok. A run of
    one environment: `evaluate` itself. `seeds`: the levels every task plays instead of its held-out ones."""
    from vagen.config import task_configs

    if not cfg.rollout.tasks:
        return evaluate(model, encoder, cfg, episodes, out_dir, videos, dist, with_baselines, desc, decoder, seeds,
                        decoy_frames)
    out_dir, summary, rows = Path(out_dir), {"videos": 0}, {}
    for name, sub in task_configs(cfg):
        if tasks and name not in tasks:
            continue
        part = evaluate(model, encoder, sub, episodes, out_dir / name, videos, dist, with_baselines,
                        f"{desc} {name}" if desc else None, decoder, seeds,
                        decoy_frames and sub.env.render_mode == "vision")
        rows[name] = part
        summary["videos"] += part.pop("videos")
        summary.update({f"{name}/{key}": value for key, value in part.items()})
    for key in ("success", "return", "format_ok"):  # every task plays the same number of episodes
        values = [part[key] for part in rows.values() if part.get(key) is not None]
        summary[key] = float(np.mean(values)) if values else None
    if dist is None or dist.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tables = [(out_dir / name / "results.md").read_text() for name in rows]
        links = "".join(f"- {name}: [results]({name}/results.md), [episodes]({name}/index.html)\n" for name in rows)
        (out_dir / "results.md").write_text(f"{links}\n" + "\n".join(tables))
        items = "".join(f'<li><a href="{name}/index.html">{name}</a>: success {rows[name]["success"]:.3f} over '
                        f'{rows[name]["episodes"]} episodes</li>' for name in rows)
        (out_dir / "index.html").write_text(f"<!doctype html><meta charset=utf-8><title>{cfg.name}</title>"
                                            f"<h1>{cfg.name}: episodes by task</h1><ul>{items}</ul>\n")
        (out_dir / "results.json").write_text(json.dumps(
            {"config": cfg.name, "tasks": {name: json.loads((out_dir / name / "results.json").read_text())
                                           for name in rows}}, indent=2))
    return summary


def results_table(env_name: str, model: dict, references: dict, decoy: dict | None = None) -> str:
    header = ("| policy | episodes | success (95% CI) | return | turns | actions | format ok | action valid "
              "| response length |\n|---|---|---|---|---|---|---|---|---|\n")

    def fmt(value, digits=2):
        return "–" if value is None else f"{value:.{digits}f}"

    def row(name, s):
        low, high = s["success_ci95"]
        return (f"| {name} | {s['episodes']} | {s['success']:.3f} ({low:.3f}–{high:.3f}) | {fmt(s['return'])} | "
                f"{fmt(s['turns'])} | {fmt(s['actions'])} | {fmt(s['format_ok'])} | {fmt(s['action_valid'])} | "
                f"{fmt(s['response_length'], 1)} |\n")

    body = row("model", model) + (row("model, decoy frames", decoy) if decoy is not None else "")
    body += "".join(row(name, s) for name, s in references.items())
    table = f"### {env_name}\n\n{header}{body}"
    if model.get("model_errors"):
        table += (f"\n{model['model_errors']} more episode(s) ended as model errors (the served model's requests "
                  f"failed on every try): left out of the model's row; results.json names them.\n")
    if model.get("frame_gap") is not None:
        table += (f"\nFrame gap (responses scored with their own frames against another episode's): "
                  f"{model['frame_gap']:.2f} nats/turn, positive on {model['frame_gap_positive']:.2f} of "
                  f"{model['frame_gap_turns']:.0f} turns.\n")
    return table


def think_with_scores(info: dict) -> str:
    """The <think> fields of a structured response, each labelled, with the grade of <observation>
    and <prediction> against the true state next to them ("" for a free-form or unparsed response)."""
    parsed = info.get("parsed") or {}
    scores = {"observation": info.get("grounding_score"), "prediction": info.get("worldmodel_score")}
    parts = []
    for name in ("observation", "reasoning", "prediction"):
        if parsed.get(name):
            score = scores.get(name)
            parts.append(f"{name}{f' [score {score:.2f}]' if score is not None else ''}: {parsed[name]}")
    return "  ".join(parts)


def write_video(cfg, episode, out_dir: Path) -> list[Path]:
    """mp4 + GIF of one episode: a frame per executed action with the turn's think and answer."""
    from vagen.rollout import make_env
    from vagen.video import EpisodeStep, write_episode_video

    env = make_env(cfg.env)
    env.reset(seed=episode.seed)
    try:
        initial = env.render_video_frame()
    except NotImplementedError:
        return []  # a text-only environment has nothing to show
    finally:
        if hasattr(env, "close"):
            env.close()
    steps, total = [], 0.0
    for number, turn in enumerate(episode.turns, start=1):
        parsed = turn.info.get("parsed", {})
        think, answer = think_with_scores(turn.info) or parsed.get("think", ""), parsed.get("answer") or turn.response
        frames = turn.info.get("frames", [])
        action_total = sum(r for _, r, _ in frames)
        for k, (action, reward, frame) in enumerate(frames):
            # The turn's format reward (or penalty) is booked on its last action.
            if k == len(frames) - 1:
                reward += turn.reward - action_total
            total += reward
            steps.append(EpisodeStep(frame, number, think, answer, action, reward, total))
        if not frames:
            total += turn.reward
            last = steps[-1].frame if steps else initial
            steps.append(EpisodeStep(last, number, think, answer, "(no valid action)", turn.reward, total))
    return write_episode_video(initial, steps, episode.success, out_dir, cfg.env.name, episode.seed)


def resolve_checkpoint(path: str) -> Path:
    """The actor directory of a checkpoint: accepts `.../step_N`, `.../step_N/actor`, a run directory
    (its latest checkpoint), a shipped warm start `assets:NAME` or any Hugging Face checkpoint directory."""
    if path.startswith("assets:"):
        from vagen.config import checkpoints_dir, model_path_error

        problem = model_path_error(path)
        if problem:
            raise FileNotFoundError(f"--checkpoint {path!r} " + problem.replace(f"model.path={path!r} ", "", 1))
        return checkpoints_dir() / path.removeprefix("assets:")
    p = Path(path)
    if (p / "checkpoints" / "latest").exists():
        p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
    if (p / "actor" / "config.json").exists():
        p = p / "actor"
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"--checkpoint {path!r}: no model there (expected config.json); pass a run directory, "
            "runs/<run>/checkpoints/step_N, a shipped warm start assets:NAME, or a Hugging Face checkpoint directory"
        )
    return p


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a resolved checkpoint lies in (`runs/<run>/checkpoints/step_N/actor`, or a checkpoint
    written beside them such as `runs/<run>/merged`), None outside any run. A run directory holds the run's
    `config.yaml` and its `checkpoints/`."""
    for folder in [checkpoint, *list(checkpoint.parents)[:3]]:
        if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


# What decides how a checkpoint plays: a difference here changes the scores, not just the bookkeeping.
COMPARED_KEYS = ("rollout.max_new_tokens", "rollout.max_turns", "model.dtype")


def config_differences(cfg, run_cfg) -> list[str]:
    """`key value (the run: value)` for each of COMPARED_KEYS and env.* where `cfg` and `run_cfg` differ."""
    keys = [*COMPARED_KEYS, *(f"env.{f.name}" for f in dataclasses.fields(cfg.env))]
    out = []
    for key in keys:
        section, name = key.split(".")
        mine, theirs = getattr(getattr(cfg, section), name), getattr(getattr(run_cfg, section), name)
        if mine != theirs:
            out.append(f"{key}={mine} (the run: {theirs})")
    return out


def choose_config(config: str | list[str] | None, checkpoint_arg: str, checkpoint: Path, overrides: list[str]):
    """(config, where it came from, warning or None) for evaluating `checkpoint`: the run's own config.yaml
    when the checkpoint lies in a run directory, `config` when given (a warning names what differs from the
    run's, or that the run's no longer loads), a ConfigError when neither exists."""
    from vagen.config import ConfigError, load_config

    run = run_dir_of(checkpoint)
    run_cfg, warning = None, None
    if run:
        try:
            # model.path names the checkpoint evaluated, so a run whose starting checkpoint has moved still loads
            run_cfg = load_config(str(run / "config.yaml"), [f"model.path={checkpoint}", *overrides])
        except ConfigError as err:  # e.g. a key a later vagen removed: --config can still evaluate the run
            if config is None:
                raise ConfigError(f"the run's config {run / 'config.yaml'} does not load: {err}; pass the config "
                                  f"to evaluate it with (--config NAME)") from None
            warning = f"warning: the run's config {run / 'config.yaml'} does not load ({err}); evaluating with --config's"
    if config is None:
        if run_cfg is None:
            raise ConfigError(f"--checkpoint {checkpoint_arg!r} is not inside a run directory (none of {checkpoint} "
                              f"and its parents holds a config.yaml beside checkpoints/), so there is no run config "
                              f"to evaluate it with; pass the config it plays, e.g. --config "
                              f"{_suggested_config(checkpoint)}")
        return run_cfg, str(run / "config.yaml"), None
    cfg = load_config(config, overrides)
    config = ",".join(config) if isinstance(config, list) else config
    if run_cfg is not None:
        differences = config_differences(cfg, run_cfg)
        if differences:
            warning = (f"warning: --config {config} differs from the run's config {run / 'config.yaml'} in "
                       f"{', '.join(differences)}; evaluating with --config's (leave --config out to evaluate "
                       f"as the run was trained)")
    return cfg, config, warning


def check_tasks(cfg, names: list[str] | None) -> None:
    """`--task NAME`: a task of the config's rollout.tasks."""
    from vagen.config import ConfigError, _closest

    if not names:
        return
    choices = [task.name for task in cfg.rollout.tasks]
    if not choices:
        raise ConfigError(f"--task {names[0]}: config {cfg.name} trains one environment ({cfg.env.name}), not "
                          f"rollout.tasks; leave --task out")
    for name in names:
        if name not in choices:
            raise ConfigError(f"--task {name} is not a task of config {cfg.name}{_closest(name, choices)} tasks: "
                              f"{', '.join(choices)}")


def parse_seeds(value: str) -> list[int]:
    """`--seeds`: level seeds as a comma (or space) separated list, or the path of a file holding one (a JSON
    list, or seeds separated by commas, spaces or lines)."""
    text = Path(value).read_text() if Path(value).is_file() else value
    tokens = text.replace("[", " ").replace("]", " ").replace(",", " ").split()
    seeds = []
    for token in tokens:
        try:
            seeds.append(int(token))
        except ValueError:
            raise ValueError(f"--seeds {value!r}: {token!r} is not an integer seed; expected e.g. --seeds 0,1,2 or "
                             f"the path of a file listing seeds") from None
    if not seeds:
        raise ValueError(f"--seeds {value!r} lists no seed; expected e.g. --seeds 0,1,2 or a file listing seeds")
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ValueError(f"--seeds lists {repeated} more than once; each level is one episode (results are by seed)")
    return seeds


def check_decoy_frames(cfg, decoy_frames: bool) -> None:
    """`--decoy-frames`: an environment (or a task) that shows frames."""
    from vagen.config import ConfigError
    from vagen.frame_check import is_visual

    if decoy_frames and not is_visual(cfg):
        raise ConfigError(f"--decoy-frames swaps the frames of a visual environment, but config {cfg.name} plays "
                          f"{cfg.env.name} with env.render_mode={cfg.env.render_mode}, which shows none; leave "
                          f"--decoy-frames out")


def _suggested_config(checkpoint: Path) -> str:
    """The config a shipped warm start's card names, else a config name to show as an example."""
    card = checkpoint / "card.json"
    if card.is_file():
        name = json.loads(card.read_text()).get("config")
        if isinstance(name, str):
            return name
    return "sokoban_visual"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, action="append",
                        help="config name or YAML path, several (repeated, or a comma list) applied in order; default "
                             "for a checkpoint inside a run directory: the run's own config.yaml (required otherwise)")
    parser.add_argument("--checkpoint", default=None,
                        help="run dir, checkpoints/step_N, a shipped warm start assets:NAME, or a HF checkpoint dir "
                             "(--policy checkpoint)")
    parser.add_argument("--policy", choices=("checkpoint", "openai"), default="checkpoint",
                        help="checkpoint: decode --checkpoint here; openai: a model behind an OpenAI-compatible chat "
                             "API (--base-url, --model)")
    parser.add_argument("--base-url", default=None, help="--policy openai: the API's root, e.g. "
                                                          "http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="--policy openai: the model's name on the server")
    parser.add_argument("--api-key-env", default=None,
                        help="--policy openai: the environment variable holding the API key (sent as a bearer "
                             "token; never printed or written); default: no key")
    parser.add_argument("--max-concurrency", type=int, default=8, help="--policy openai: requests at once at most")
    parser.add_argument("--max-retries", type=int, default=6,
                        help="--policy openai: retries of a request after 429, 5xx, a timeout or a lost connection")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="--policy openai: seconds per request")
    parser.add_argument("--token-param", default="max_tokens",
                        help="--policy openai: the request field of rollout.max_new_tokens: max_tokens, or "
                             "max_completion_tokens (OpenAI's reasoning models)")
    parser.add_argument("--omit", default="",
                        help="--policy openai: request fields the server refuses, left out (comma list of seed, "
                             "temperature, top_p)")
    parser.add_argument("--seeds", default=None,
                        help="the level seeds to play instead of --episodes held-out ones: a list (0,1,2) or a file "
                             "listing them")
    parser.add_argument("--episodes", type=int, default=None, help="held-out episodes (default eval.episodes)")
    parser.add_argument("--videos", type=int, default=None, help="episode videos (default eval.videos)")
    parser.add_argument("--out", default=None, help="output directory (default <checkpoint>/eval; for assets:NAME "
                                                     "<train.run_dir>/eval/NAME)")
    parser.add_argument("--task", default=None, action="append",
                        help="a config with rollout.tasks: evaluate this task only (its name in metrics, e.g. "
                             "sokoban_visual); repeat for several; default: every task")
    parser.add_argument("--decoy-frames", action="store_true",
                        help="play the levels again with each observation's frames from another evaluation level "
                             "(a decoy) and report that success beside the success with their own frames")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from vagen.config import ConfigError

    try:
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    except (ValueError, OSError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.policy == "openai":
        return evaluate_served(args, seeds)
    if args.checkpoint is None:
        print("config error: --checkpoint is required with --policy checkpoint (the default); pass a run directory, "
              "a checkpoint or assets:NAME, or --policy openai --base-url URL --model NAME for a served model",
              file=sys.stderr)
        return 2
    checkpoint = resolve_checkpoint(args.checkpoint)
    try:
        cfg, source, warning = choose_config(args.config, args.checkpoint, checkpoint, args.overrides)
        check_tasks(cfg, args.task)
        check_decoy_frames(cfg, args.decoy_frames)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from vagen.preflight import checkpoint_problems, missing_packages

    # vLLM's absence, an unknown model family, image hooks under vLLM: refused before anything loads
    problems = missing_packages(cfg, trackers=False) + checkpoint_problems(cfg, str(checkpoint), "--checkpoint")
    if problems:
        print("\n".join(f"config error: {problem}" for problem in problems), file=sys.stderr)
        return 2
    from vagen.distributed import init_distributed
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy

    dist = init_distributed(need_group=False)  # the start training uses: the rank's device, threads, group
    rank = dist.rank
    # the image bounds of the config, as training applies them
    model, processor = load_policy(checkpoint, cfg.model.dtype, cfg.model.min_pixels, cfg.model.max_pixels,
                                   cfg.model.attn_implementation)
    model.to(dist.device)
    if args.out:
        out = Path(args.out)
    elif args.checkpoint.startswith("assets:"):  # never into the repository's assets
        out = Path(cfg.train.run_dir) / "eval" / args.checkpoint.removeprefix("assets:")
    else:
        out = checkpoint.parent / "eval"
    episodes = args.episodes if args.episodes is not None else cfg.eval.episodes
    episodes = len(seeds) if seeds is not None else episodes
    videos = args.videos if args.videos is not None else cfg.eval.videos
    if rank == 0:
        if warning:
            print(warning, file=sys.stderr, flush=True)
        what = ", ".join(args.task or [t.name for t in cfg.rollout.tasks]) or cfg.env.name
        print(f"evaluating {checkpoint} on {episodes} {'listed' if seeds else 'held-out'} {what} episodes"
              f"{' per task' if cfg.rollout.tasks else ''} "
              f"(config {cfg.name}: {source})", flush=True)
    encoder = ChatEncoder(processor)
    decoder = None
    if cfg.rollout.backend == "vllm":  # an engine over the evaluated checkpoint itself, on each rank
        from vagen.decoding_vllm import VLLMDecoder, settings_from

        decoder = VLLMDecoder(checkpoint, encoder, dtype=cfg.model.dtype, seed=cfg.eval.sample_seed + rank,
                              episodes=max(1, -(-episodes // dist.world_size)),  # the rank's share (`evaluate`)
                              trajectory_length=cfg.rollout.max_trajectory_length, **settings_from(cfg))
    try:
        summary = evaluate_tasks(model, encoder, cfg, episodes, out, videos=videos, dist=dist,
                                 desc="eval" if rank == 0 else None, decoder=decoder, tasks=args.task, seeds=seeds,
                                 decoy_frames=args.decoy_frames)
    finally:
        if decoder is not None:
            decoder.close()
    if rank == 0:
        print((out / "results.md").read_text())
        print(f"results: {out / 'results.json'}  videos: {summary['videos']} (rank 0)")
    return 0


def evaluate_served(args, seeds: list[int] | None) -> int:
    """`--policy openai`: the config's episodes played by the model at `--base-url` (`vagen.api_policy`), into the
    same results, videos and browser as a checkpoint's; exit 2 on a config error or a request the server refused."""
    from vagen.config import ConfigError, load_config

    if args.config is None or args.base_url is None or args.model is None or args.checkpoint is not None:
        print("config error: --policy openai needs --config NAME (the environment, turns and tokens per turn), "
              "--base-url URL and --model NAME, and no --checkpoint (a checkpoint is evaluated with --policy "
              "checkpoint)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        check_tasks(cfg, args.task)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    import importlib.util

    from vagen.api_policy import APIDecoder, APIError, APISettings, check_settings, load_encoder

    settings = APISettings(args.base_url, args.model, args.api_key_env, args.max_concurrency, args.max_retries,
                           timeout_s=args.request_timeout, token_param=args.token_param,
                           omit=tuple(name for name in args.omit.split(",") if name))
    problems = check_settings(settings)
    if importlib.util.find_spec("httpx") is None:
        problems.append("--policy openai sends its requests with httpx, which is not installed; "
                        "pip install -e \".[http]\"")
    if problems:
        print("\n".join(f"config error: {problem}" for problem in problems), file=sys.stderr)
        return 2
    episodes = len(seeds) if seeds is not None else (args.episodes if args.episodes is not None else cfg.eval.episodes)
    videos = args.videos if args.videos is not None else cfg.eval.videos
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.model)
    out = Path(args.out) if args.out else Path(cfg.train.run_dir) / "eval" / f"openai-{safe_name}"
    what = ", ".join(args.task or [t.name for t in cfg.rollout.tasks]) or cfg.env.name
    print(f"evaluating {args.model} at {args.base_url} on {episodes} {'listed' if seeds else 'held-out'} {what} "
          f"episodes{' per task' if cfg.rollout.tasks else ''} (config {cfg.name})", flush=True)
    encoder = load_encoder(cfg)
    decoder = APIDecoder(settings, encoder, cfg.rollout.context, cfg.rollout.window_turns)
    try:
        summary = evaluate_tasks(None, encoder, cfg, episodes, out, videos=videos, desc="eval", decoder=decoder,
                                 tasks=args.task, seeds=seeds)
    except APIError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        decoder.close()
    print((out / "results.md").read_text())
    print(f"results: {out / 'results.json'}  videos: {summary['videos']}  model errors: {decoder.model_errors}  "
          f"retried requests: {decoder.client.retries}")
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(here))
    from vagen.distributed import leave_process_group

    raise SystemExit(leave_process_group(main()))
