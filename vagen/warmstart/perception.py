"""Perception questions for the stages of a warm start: one-turn questions about the env's own frames,
answered with one digit. The first stage asks where things are ("Which row is the player in?"); the
last asks what lies on the cells a turn's later moves enter ("What is on the cell the player reaches
by moving Right, then Down?", `cell_probes`).

A tiny model fine-tuned on demonstrations can learn the answer format and the common moves from the
text alone and never start reading the frame (the build's frame check says so). These questions
have no answer without the image, so a few hundred steps on them first make the model look; the
demonstrations are learned afterwards from that checkpoint (`sft.perception_steps`, see
`vagen.warmstart.sft.perception_stage`).

    probes = perception_probes(cfg.env, 2000, max_moves=8, exclude=eval_level_keys(cfg.env, 1024),
                               objects=("player",), axes=("row",))
    sample = question_sample(encoder, model, probes[0].frame, probes[0].question, probes[0].answer)

Frames are the ones an episode shows: for `perception_probes` a level's start after a random number of
the teacher's moves, for `cell_probes` a level's start with the player moved to a random cell where it
can stand.
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vagen.episode import ChatEncoder, Episode, Turn
from vagen.rollout import make_env
from vagen.warmstart.demos import distinct_levels

# state() keys of objects that sit on one cell, and how a question names them
OBJECTS = {"player": "the player", "boxes": "the box", "targets": "the target"}
SYSTEM_PROMPT = "Answer with one digit."
AXES = {"row": "Rows are numbered 0 to {last} from the top.", "column": "Columns are numbered 0 to {last} from the left."}


@dataclass
class Probe:
    """One question: the level's seed, the frame shown, the question text and the answer digit."""

    seed: int
    frame: Image.Image
    question: str
    answer: int | str  # a digit; manipulation's copy questions answer with an action


def single_cell_objects(state: dict, keys=tuple(OBJECTS)) -> dict[str, tuple[int, int]]:
    """The objects of an env's `state()` (among `keys`) that occupy exactly one cell, by their name in a
    question."""
    out = {}
    for key, name in ((k, OBJECTS[k]) for k in keys):
        value = state.get(key)
        if isinstance(value, tuple):
            out[name] = value
        elif isinstance(value, list) and len(value) == 1:
            out[name] = tuple(value[0])
    return out


def question(name: str, axis: str, size: int) -> str:
    """The question text for `name`'s `axis` (row | column) on a grid `size` cells along it, image last."""
    return f"Which {axis} is {name} in? {AXES[axis].format(last=size - 1)}\n<image>"


def perception_probes(cfg_env, n: int, max_moves: int, exclude: set[str] = frozenset(), start_seed: int = 0,
                      max_draws: int | None = None, objects=tuple(OBJECTS), axes=("row", "column")) -> list[Probe]:
    """`n` questions on distinct levels from seeds `start_seed, start_seed + 1, …`, skipping levels in
    `exclude`. Each level is played for a random number (0 to `max_moves`) of the teacher's moves;
    the question asks for one of `axes` of one of its single-cell `objects` (state() keys: player,
    boxes, targets), both drawn from the seed."""
    unknown = [key for key in objects if key not in OBJECTS]
    if unknown:
        raise ValueError(f"perception questions about {unknown} are not available; choose among "
                         f"{', '.join(OBJECTS)} (sft.perception_objects)")
    env = make_env(cfg_env, {"render_mode": "vision", "prompt_format": "no_think"})  # bare <answer> moves
    env.reset(seed=start_seed)
    if not hasattr(env, "state") or not single_cell_objects(env.state(), objects):
        raise ValueError(f"env {cfg_env.name!r} has no grid state with a player, box or target to ask about, so it "
                         f"has no perception stage; set sft.perception_steps=0")
    teacher = importlib.import_module(type(env).__module__).teacher_action
    probes = []
    for seed in distinct_levels(env, n, itertools.count(start_seed), exclude, max_draws,
                                "set sft.perception_levels lower"):
        rng = np.random.default_rng([seed, 13])
        for _ in range(int(rng.integers(max_moves + 1))):
            _, _, terminated, truncated, info = env.step(f"<answer>{teacher(env.state(), rng)}</answer>")
            assert info["format_ok"], f"the teacher's move does not parse in {cfg_env.name}"
            if terminated or truncated:
                break
        state = env.state()
        cells = single_cell_objects(state, objects)
        name = sorted(cells)[int(rng.integers(len(cells)))]
        axis = axes[int(rng.integers(len(axes)))]
        size = state["size"][0 if axis == "row" else 1]
        probes.append(Probe(seed, env.render_image(), question(name, axis, size),
                            cells[name][0 if axis == "row" else 1]))
    return probes


def question_sample(encoder: ChatEncoder, model, frame: Image.Image, text: str, answer: int | str, seed: int = 0,
                    system_prompt: str = SYSTEM_PROMPT):
    """A one-turn training sample (`vagen.trajectory.Sample`): `text` with `frame`, answered
    `<answer>ANSWER</answer>`, tokenised as `rollout` would."""
    from vagen.trajectory import episode_to_sample

    episode = Episode("probe", seed, 0, system_prompt)
    ids, pixel_values, grids = encoder.user_segment(text, [frame], True, episode.system_prompt)
    generated, response = encoder.finish_response(encoder.encode_text(f"<answer>{answer}</answer>"))
    episode.input_ids = ids + generated
    episode.pixel_values, episode.image_grid_thw = pixel_values, grids
    episode.turns.append(Turn(text, [frame], response, 0.0, {}, (len(ids), len(episode.input_ids)), len(generated)))
    return episode_to_sample(episode, encoder, model)


# Envs whose perception stage asks its own questions: the module whose `stage_probes(cfg, n, exclude)`
# writes them (a new env's questions are a new module named here); the others ask `perception_probes`'s.
QUESTION_MODULES = {"navigation": "vagen.warmstart.navigation_questions",
                    "manipulation": "vagen.warmstart.manipulation_questions"}


def stage_probes(cfg, n: int, exclude: set[str] = frozenset()) -> list[Probe]:
    """The perception stage's `n` questions for `cfg`'s env on distinct levels outside `exclude`: its own
    module's (`QUESTION_MODULES`), else `perception_probes` about `sft.perception_objects` along
    `sft.perception_axes` after up to a whole episode's moves."""
    if cfg.env.name in QUESTION_MODULES:
        return importlib.import_module(QUESTION_MODULES[cfg.env.name]).stage_probes(cfg, n, exclude)
    moves = cfg.rollout.max_turns * cfg.env.max_actions_per_turn - 1  # any frame an episode can show
    return perception_probes(cfg.env, n, moves, exclude, objects=tuple(cfg.sft.perception_objects),
                             axes=tuple(cfg.sft.perception_axes))


# -- questions about the cells a turn's later moves enter ---------------------------------------------

# what a cell can hold, by env: the answer digit is the index; the last is always "off the map"
CELL_ANSWERS = {
    "frozenlake": ("frozen ice", "a hole", "the goal", "off the map"),
    "sokoban": ("floor", "a wall", "a box", "a target", "off the map"),
}


def cell_question(moves: list[str], env_name: str = "frozenlake") -> str:
    """The question about the cell that `moves` (direction names) from the player reach, image last."""
    answers = ", ".join(f"{digit} = {name}" for digit, name in enumerate(CELL_ANSWERS[env_name]))
    return f"What is on the cell the player reaches by moving {', then '.join(moves)}? {answers}.\n<image>"


def cell_kind(state: dict, cell: tuple[int, int]) -> int:
    """CELL_ANSWERS digit of `cell` on a FrozenLake or Sokoban `state()` (the env is told by its keys).
    A box on a target is a box: it is what decides a move."""
    rows, cols = state["size"]
    frozenlake = "holes" in state
    if not (0 <= cell[0] < rows and 0 <= cell[1] < cols):
        return len(CELL_ANSWERS["frozenlake" if frozenlake else "sokoban"]) - 1
    if frozenlake:
        return 1 if cell in set(map(tuple, state["holes"])) else 2 if cell == tuple(state["goal"]) else 0
    for digit, key in ((1, "walls"), (2, "boxes"), (3, "targets")):
        if cell in set(map(tuple, state[key])):
            return digit
    return 0


def cell_answer(state: dict, player: tuple[int, int], moves: list[str]) -> int:
    """CELL_ANSWERS digit of the cell that `moves` from `player` reach on a FrozenLake or Sokoban
    `state()`. The moves add up to an offset from the player (Right, then Left is the player's own
    cell) and ignore what lies between; a cell outside the map is "off the map"."""
    from envs_visual.grid import DIRECTIONS

    row = player[0] + sum(DIRECTIONS[m][0] for m in moves)
    col = player[1] + sum(DIRECTIONS[m][1] for m in moves)
    return cell_kind(state, (row, col))


def standing_cells(state: dict) -> list[tuple[int, int]]:
    """Cells where a question may stand the player: FrozenLake's that are neither a hole nor the goal,
    Sokoban's floor and targets without a box."""
    rows, cols = state["size"]
    blocked = {1, 2}  # FrozenLake: hole, goal; Sokoban: wall, box
    return [(r, c) for r in range(rows) for c in range(cols) if cell_kind(state, (r, c)) not in blocked]


def cell_probes(cfg_env, n: int, moves=(1, 2), exclude: set[str] = frozenset(), start_seed: int = 0,
                per_level: int = 2, max_draws: int | None = None) -> list[Probe]:
    """`n` questions "what is on the cell the player reaches by moving Right, then Down?" on distinct
    FrozenLake or Sokoban levels from seeds `start_seed, start_seed + 1, …` (skipping `exclude`),
    `per_level` per level: the player stands on a random cell of `standing_cells` of the level's
    start, and the number of moves (drawn from `moves`) and their directions are random. These are
    the cells that the later moves of a turn enter, which a policy must read from the turn's one
    frame."""
    from envs_visual.grid import DIRECTIONS

    if cfg_env.name not in CELL_ANSWERS:
        raise ValueError(f"questions about the cells ahead of the player are defined for {', '.join(CELL_ANSWERS)}, "
                         f"not {cfg_env.name!r}; set sft.cell_questions=0")
    if not moves or min(moves) < 1:
        raise ValueError(f"moves={list(moves)}: each question needs at least one move; use e.g. [1, 2]")
    env = make_env(cfg_env, {"render_mode": "vision", "prompt_format": "no_think"})
    names = sorted(DIRECTIONS)
    probes = []
    for seed in distinct_levels(env, -(-n // per_level), itertools.count(start_seed), exclude, max_draws,
                                "set sft.cell_questions lower"):
        rng = np.random.default_rng([seed, 29])
        state = env.state()
        free = standing_cells(state)
        for _ in range(per_level):
            player = free[int(rng.integers(len(free)))]
            env.place_player(player)
            count = moves[int(rng.integers(len(moves)))]
            path = [str(m) for m in rng.choice(names, size=count)]
            probes.append(Probe(seed, env.render_image(), cell_question(path, cfg_env.name),
                                cell_answer(state, player, path)))
    return probes[:n]
