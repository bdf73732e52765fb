"""GiGPO: `vagen.core.gigpo_advantages` (hand-checked, naive loop, invariances, errors), every env's
`info["state_key"]`, the rollout's per-turn anchor keys, the trainer's placement of turn advantages on
tokens, the config keys, and one training iteration with `algo.adv_estimator=gigpo`."""

import json
import math

import pytest
import torch
from scripted import ScriptedDecoder

import envs_visual
from envs_visual.base import format_response
from envs_visual.frozenlake import FrozenLakeLevel
from envs_visual.sokoban import SokobanLevel
from vagen.config import ConfigError, load_config
from vagen.core import gigpo_advantages
from vagen.trajectory import Sample

EPS = 1e-6

# ----------------------------------------------------------------------------- core: hand-checked

# Two level groups. Group 7: three trajectories; anchor state "a" is shared by the first turn of all
# three, "b" by turn 1 of the first and turns 1 and 2 of the third (a state revisited inside one
# trajectory), "c" is a singleton. Group 3: state id 0 ("a" again, but another level: never merged
# with group 7's) shared by both first turns, "e" a singleton. The last column is padding.
A, B, C, E, PAD = 0, 1, 2, 4, 9
HAND_REWARDS = torch.tensor([
    [1.0, 3.0, 0.0, 99.0],
    [0.0, 2.0, 0.0, 99.0],
    [0.0, 0.0, 6.0, 99.0],
    [1.0, 0.0, 0.0, 99.0],
    [0.0, 0.0, 0.0, 99.0],
])
HAND_MASK = torch.tensor([
    [1, 1, 0, 0],
    [1, 1, 0, 0],
    [1, 1, 1, 0],
    [1, 1, 0, 0],
    [1, 0, 0, 0],
])
HAND_STATES = torch.tensor([
    [A, B, PAD, PAD],
    [A, C, PAD, PAD],
    [A, B, B, PAD],
    [A, E, PAD, PAD],
    [A, PAD, PAD, PAD],
])
HAND_GROUPS = torch.tensor([7, 7, 7, 3, 3])
# gamma = 0.5: returns-to-go
#   row 0: [1 + 0.5 * 3, 3] = [2.5, 3]         episode return 4
#   row 1: [0 + 0.5 * 2, 2] = [1, 2]           episode return 2
#   row 2: [0.5 * 3, 0 + 0.5 * 6, 6] = [1.5, 3, 6]   episode return 6
#   row 3: [1, 0]                              episode return 1
#   row 4: [0]                                 episode return 0
# group 7 episodes: mean 4, centred [0, -2, 2], unbiased std 2
# group 3 episodes: mean 0.5, centred [0.5, -0.5], std sqrt(0.5)
# step group (7, a): [2.5, 1, 1.5], mean 5/3, centred [5/6, -2/3, -1/6], std sqrt(7/12)
# step group (7, b): [3, 3, 6], mean 4, centred [-1, -1, 2], std sqrt(3)
# step group (3, a): [1, 0], mean 0.5, centred [0.5, -0.5], std sqrt(0.5)
# singletons (7, c) and (3, e): 0


def _hand(norm, step_weight):
    return gigpo_advantages(HAND_REWARDS, HAND_MASK, HAND_GROUPS, HAND_STATES, 0.5, step_weight, norm, eps=EPS)


def test_hand_checked_case_with_mean_normalisation():
    advantages, metrics = _hand("mean", 1.0)
    expected = torch.tensor([
        [0 + 5 / 6, 0 - 1, 0, 0],
        [-2 - 2 / 3, -2 + 0, 0, 0],
        [2 - 1 / 6, 2 - 1, 2 + 2, 0],
        [0.5 + 0.5, 0.5 + 0, 0, 0],
        [-0.5 - 0.5, 0, 0, 0],
    ])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)
    # 10 turns; 8 in the step groups (7, a), (7, b), (3, a); 5 step groups
    assert metrics == pytest.approx({"step_group_share": 0.8, "step_group_size": 2.0})


def test_hand_checked_case_with_mean_std_normalisation_and_a_step_weight():
    advantages, _ = _hand("mean_std", 0.5)
    e7, e3 = 2 + EPS, math.sqrt(0.5) + EPS
    sa, sb, s3 = math.sqrt(7 / 12) + EPS, math.sqrt(3) + EPS, math.sqrt(0.5) + EPS
    expected = torch.tensor([
        [0 / e7 + 0.5 * (5 / 6) / sa, 0 / e7 + 0.5 * -1 / sb, 0, 0],
        [-2 / e7 + 0.5 * (-2 / 3) / sa, -2 / e7, 0, 0],
        [2 / e7 + 0.5 * (-1 / 6) / sa, 2 / e7 + 0.5 * -1 / sb, 2 / e7 + 0.5 * 2 / sb, 0],
        [0.5 / e3 + 0.5 * 0.5 / s3, 0.5 / e3, 0, 0],
        [-0.5 / e3 + 0.5 * -0.5 / s3, 0, 0, 0],
    ], dtype=torch.float64)
    torch.testing.assert_close(advantages.double(), expected, rtol=0, atol=1e-6)


def test_step_weight_zero_is_grpo_over_episode_returns_on_every_turn():
    from vagen.core import grpo_advantages

    advantages, _ = _hand("mean_std", 0.0)
    episode = grpo_advantages(HAND_REWARDS.mul(HAND_MASK).sum(1), HAND_GROUPS)
    torch.testing.assert_close(advantages, episode[:, None] * HAND_MASK, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- core: naive loop


def gigpo_ref(turn_rewards, turn_mask, group_ids, state_ids, gamma, step_weight, norm, eps=EPS):
    """The docstring's formula, one group at a time in Python floats."""
    rewards, mask, states, groups = turn_rewards.tolist(), turn_mask.tolist(), state_ids.tolist(), group_ids.tolist()
    turns = [[t for t in range(len(mask[i])) if mask[i][t]] for i in range(len(mask))]

    def normalised(values):
        if len(values) < 2 or max(values) == min(values):
            return [0.0] * len(values)
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        return [(v - mean) / (std + eps) if norm == "mean_std" else v - mean for v in values]

    episode = {}
    for g in set(groups):
        members = [i for i in range(len(groups)) if groups[i] == g]
        for i, a in zip(members, normalised([sum(rewards[i][t] for t in turns[i]) for i in members])):
            episode[i] = a
    to_go = {}
    for i in range(len(groups)):
        running = 0.0
        for t in reversed(turns[i]):
            running = rewards[i][t] + gamma * running
            to_go[i, t] = running
    step = {}
    for key in {(groups[i], states[i][t]) for i in range(len(groups)) for t in turns[i]}:
        members = [(i, t) for i in range(len(groups)) for t in turns[i] if (groups[i], states[i][t]) == key]
        for member, a in zip(members, normalised([to_go[m] for m in members])):
            step[member] = a
    out = [[0.0] * len(row) for row in rewards]
    for i in range(len(groups)):
        for t in turns[i]:
            out[i][t] = episode[i] + step_weight * step[i, t]
    sizes = {}
    for i in range(len(groups)):
        for t in turns[i]:
            sizes[groups[i], states[i][t]] = sizes.get((groups[i], states[i][t]), 0) + 1
    n_turns = sum(sizes.values())
    share = sum(n for n in sizes.values() if n >= 2) / n_turns if n_turns else 0.0
    return torch.tensor(out, dtype=torch.float64), {"step_group_share": share,
                                                    "step_group_size": n_turns / len(sizes) if sizes else 0.0}


def random_case(seed: int, batch: int = 12, turns: int = 7):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, turns, generator=g, dtype=torch.float64)
    rewards[:, 1] = torch.round(rewards[:, 1])  # some equal returns, some degenerate groups
    mask = torch.rand(batch, turns, generator=g) < 0.75
    mask[0] = False  # a trajectory without turns
    mask[1] = True
    groups = torch.randint(0, 3, (batch,), generator=g) * 10 - 5  # any labels, negative ones too
    groups[-1] = 99  # a level group of one
    states = torch.randint(0, 4, (batch, turns), generator=g)
    states[-1] = torch.arange(turns) + 10  # every state of that group's one trajectory new: singleton step groups
    return rewards, mask, groups, states


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm", ["mean_std", "mean"])
@pytest.mark.parametrize("gamma, step_weight", [(0.95, 1.0), (1.0, 0.5), (0.0, 2.0), (0.3, 0.0)])
def test_equals_a_naive_per_group_loop_on_random_data(seed, norm, gamma, step_weight):
    rewards, mask, groups, states = random_case(seed)
    advantages, metrics = gigpo_advantages(rewards, mask, groups, states, gamma, step_weight, norm, eps=EPS)
    expected, expected_metrics = gigpo_ref(rewards, mask, groups, states, gamma, step_weight, norm)
    torch.testing.assert_close(advantages, expected, rtol=1e-9, atol=1e-9)
    assert metrics["step_group_share"] == pytest.approx(expected_metrics["step_group_share"], abs=1e-12)
    assert metrics["step_group_size"] == pytest.approx(expected_metrics["step_group_size"], abs=1e-12)
    assert 0 < metrics["step_group_share"] < 1 and metrics["step_group_size"] > 1


@pytest.mark.parametrize("seed", range(4))
def test_invariant_to_the_order_of_trajectories_and_to_relabelling(seed):
    rewards, mask, groups, states = random_case(seed)
    advantages, metrics = gigpo_advantages(rewards, mask, groups, states, 0.9, 1.0, "mean_std")
    order = torch.randperm(rewards.shape[0], generator=torch.Generator().manual_seed(100 + seed))
    shuffled, shuffled_metrics = gigpo_advantages(rewards[order], mask[order], groups[order], states[order], 0.9,
                                                  1.0, "mean_std")
    torch.testing.assert_close(shuffled, advantages[order], rtol=0, atol=1e-12)
    assert shuffled_metrics == pytest.approx(metrics, abs=1e-12)
    # other labels for the same partition into level groups and anchor states change nothing
    relabelled, _ = gigpo_advantages(rewards, mask, groups * 3 + 1000, states * 7 - 2, 0.9, 1.0, "mean_std")
    torch.testing.assert_close(relabelled, advantages, rtol=0, atol=0)


def test_masked_out_turns_are_skipped_not_chained_through():
    rewards, mask, groups, states = random_case(0)
    advantages, _ = gigpo_advantages(rewards, mask, groups, states, 0.8, 1.0, "mean")
    junk_rewards = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    junk_states = torch.where(mask, states, torch.full_like(states, 3))
    again, _ = gigpo_advantages(junk_rewards, mask, groups, junk_states, 0.8, 1.0, "mean")
    torch.testing.assert_close(again, advantages, rtol=0, atol=0)
    assert (advantages[~mask] == 0).all()


def test_a_changed_anchor_state_changes_only_its_step_groups():
    # Splitting a step group changes the advantages of its members and of no other turn.
    rewards, mask, groups = HAND_REWARDS, HAND_MASK, HAND_GROUPS
    before, _ = gigpo_advantages(rewards, mask, groups, HAND_STATES, 0.5, 1.0, "mean")
    states = HAND_STATES.clone()
    states[2, 2] = C + 10  # the third trajectory's revisit of b becomes a new state
    after, metrics = gigpo_advantages(rewards, mask, groups, states, 0.5, 1.0, "mean")
    changed = (after - before).abs() > 1e-9
    assert changed.nonzero().tolist() == [[0, 1], [2, 1], [2, 2]]
    assert after[2, 2] == pytest.approx(2.0)  # a singleton: the episode advantage alone
    assert metrics["step_group_share"] == pytest.approx(0.7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"norm": "std"}, r"unknown norm 'std'; choices: 'mean_std', 'mean'"),
        ({"gamma": 1.5}, r"gamma must be a float in \[0, 1\], got 1.5"),
        ({"step_weight": float("nan")}, r"step_weight must be a finite float, got nan"),
        ({"state_ids": HAND_STATES.float()}, r"state_ids must be an integer tensor, got torch.float32"),
        ({"group_ids": HAND_GROUPS[:3]}, r"group_ids has 3 entries but turn_rewards has 5 rows"),
        ({"turn_mask": HAND_MASK[:, :3]}, r"turn_mask has shape \(5, 3\) but turn_rewards has shape \(5, 4\)"),
    ],
)
def test_bad_inputs_say_what_was_received(kwargs, match):
    args = {"turn_rewards": HAND_REWARDS, "turn_mask": HAND_MASK, "group_ids": HAND_GROUPS,
            "state_ids": HAND_STATES, "gamma": 0.5, "step_weight": 1.0, "norm": "mean", **kwargs}
    with pytest.raises(ValueError, match=match):
        gigpo_advantages(**args)


# ----------------------------------------------------------------------------- environments' state keys

ROOM = """
######
#____#
#_P__#
#_X_O#
######
"""
LAKE = """
P___
_O__
____
___G
"""


def _answer(env, actions: str) -> str:
    return format_response(env.prompt_format, actions)


def _walk(env, answers):
    keys = []
    for answer in answers:
        *_, info = env.step(answer)
        keys.append(info["state_key"])
        hash(info["state_key"])
    return keys


def test_sokoban_state_key_through_a_walk_that_revisits_a_state():
    env = envs_visual.make("sokoban", render_mode="text")
    _, info = env.load_level(SokobanLevel.from_text(ROOM))
    start = info["state_key"]
    left, back, pushed, up = _walk(env, [_answer(env, "Left"), _answer(env, "Right"),
                                         _answer(env, "Left, Down, Right"), _answer(env, "Up")])
    assert left != start and back == start  # the player returned: the same room
    assert env.state()["player"] == (2, 2) and env.state()["boxes"] == [(3, 3)]
    assert pushed not in (start, left) and up not in (start, left, pushed)  # the player's start cell, the box moved
    again = envs_visual.make("sokoban", render_mode="vision")
    assert again.load_level(SokobanLevel.from_text(ROOM))[1]["state_key"] == start  # render mode is not state
    # a box one cell further is another state with the player in the same place
    moved_box = ROOM.replace("#_X_O#", "#__XO#")
    assert again.load_level(SokobanLevel.from_text(moved_box))[1]["state_key"] != start
    _, first = env.reset(seed=4)
    _, other = envs_visual.make("sokoban", render_mode="text").reset(seed=4)
    assert first["state_key"] == other["state_key"]


def test_frozenlake_state_key_through_a_walk_that_revisits_a_state():
    env = envs_visual.make("frozenlake", render_mode="text")
    _, info = env.load_level(FrozenLakeLevel.from_text(LAKE))
    start = info["state_key"]
    keys = _walk(env, [_answer(env, "Right"), _answer(env, "Right"), _answer(env, "Left, Left"),
                       _answer(env, "Up")])  # Up walks off the lake: nothing changes
    assert keys[0] != start and keys[1] not in (start, keys[0])
    assert keys[2] == start and keys[3] == start
    other_map = LAKE.replace("_O__", "__O_")
    assert env.load_level(FrozenLakeLevel.from_text(other_map))[1]["state_key"] != start


def test_text_envs_state_keys_follow_the_state():
    bandit = envs_visual.make("bandit")
    _, info = bandit.reset(seed=5)
    start = info["state_key"]
    # an unknown arm keeps the episode and its state: the next turn starts where this one did
    (invalid,) = _walk(bandit, [_answer(bandit, "Nobody")])
    assert invalid == start
    (pulled,) = _walk(bandit, [_answer(bandit, bandit.arms["low_risk"])])
    assert pulled != start
    _, other = envs_visual.make("bandit").reset(seed=5)
    assert other["state_key"] == start
    high = envs_visual.make("bandit")
    high.reset(seed=5)
    assert _walk(high, [_answer(high, high.arms["high_risk"])])[0] not in (start, pulled)

    countdown = envs_visual.make("countdown")
    _, info = countdown.reset(seed=2)
    start = info["state_key"]
    assert _walk(countdown, [_answer(countdown, "1 +")]) == [start]  # no expression: nothing happened
    numbers = countdown.puzzle["numbers"]
    (answered,) = _walk(countdown, [_answer(countdown, " + ".join(map(str, numbers)))])
    assert answered != start
    other = envs_visual.make("countdown")
    other.reset(seed=2)
    assert _walk(other, [_answer(other, " - ".join(map(str, numbers)))])[0] not in (start, answered)


def test_navigation_state_key_through_a_walk_that_revisits_a_pose():
    env = envs_visual.make("navigation", render_mode="text", max_actions_per_turn=5)
    _, info = env.reset(seed=1)
    start = info["state_key"]
    turned, full_circle, looked, level = _walk(env, [
        _answer(env, "rotateleft"),
        _answer(env, "rotateleft, rotateleft, rotateleft"),  # 360 degrees: the start pose
        _answer(env, "lookup"),
        _answer(env, "lookdown"),
    ])
    assert turned != start and full_circle == start and looked not in (start, turned) and level == start
    # a step and its reverse (floating-point positions), wherever the level leaves room for one
    for there, back in (("moveahead", "moveback"), ("moveleft", "moveright"), ("moveback", "moveahead")):
        env.reset(seed=1)
        (moved,) = _walk(env, [_answer(env, there)])
        if moved != start:
            assert _walk(env, [_answer(env, back)]) == [start]
            break
    else:
        pytest.fail("no free step from the start of navigation level 1")
    _, other = envs_visual.make("navigation", render_mode="text").reset(seed=1)
    assert other["state_key"] == start
    _, elsewhere = envs_visual.make("navigation", render_mode="text").reset(seed=2)
    assert elsewhere["state_key"] != start


def test_manipulation_state_key_follows_the_objects_and_the_gripper():
    env = envs_visual.make("manipulation", task="place", render_mode="text")
    _, info = env.reset(seed=0)
    start = info["state_key"]
    # a primitive out of reach changes nothing: the next turn starts from the same state
    (unreached,) = _walk(env, [_answer(env, "pick(500, 0, 20)")])
    assert unreached == start
    cube = env.level.roles["object"]
    x, y, z = next(o["position"] for o in env.state()["objects"] if o["name"] == cube)
    (picked,) = _walk(env, [_answer(env, f"pick({x:.0f}, {y:.0f}, {z:.0f})")])
    assert env.state()["holding"] == cube and picked != start
    other = envs_visual.make("manipulation", task="place", render_mode="text")
    assert other.reset(seed=0)[1]["state_key"] == start
    other.set_object(cube, x + 30, y)
    assert other.state_key() != start
    env.close()
    other.close()


# ----------------------------------------------------------------------------- rollout and update


def test_rollout_records_the_state_each_turn_started_from(tiny_text):
    from vagen.episode import ChatEncoder
    from vagen.rollout import rollout
    from vagen.trajectory import episode_to_sample
    from vagen.update import compute_advantages

    _, _, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    cfg = load_config("sokoban_text", ["rollout.max_turns=3", "algo.adv_estimator=gigpo", "rollout.group_size=2"])
    fmt = cfg.env.prompt_format
    script = {0: [format_response(fmt, "Left"), format_response(fmt, "Right"), format_response(fmt, "Up")],
              1: ["no format", format_response(fmt, "Left"), format_response(fmt, "Right")]}
    episodes, _ = rollout(None, encoder, cfg, [3], group_size=2, decoder=ScriptedDecoder(encoder, script))
    _, reset_info = envs_visual.make("sokoban", render_mode="text").reset(seed=3)
    for ep in episodes:
        assert ep.initial_state_key == reset_info["state_key"]
        assert [t.state_key for t in ep.turns] == [reset_info["state_key"]] + [t.info["state_key"] for t in
                                                                              ep.turns[:-1]]
    first, second = episodes
    # the second episode's unparsed first turn left the room as it was
    assert second.turns[1].state_key == second.turns[0].state_key == first.turns[0].state_key
    samples = [episode_to_sample(ep, encoder) for ep in episodes]
    for s in samples:
        s.extra["old_logprobs"] = torch.zeros(s.length)
        s.extra["entropies"] = torch.zeros(s.length)
    metrics = compute_advantages(samples, cfg)
    keys = [t.state_key for ep in episodes for t in ep.turns]
    sizes = {k: keys.count(k) for k in keys}
    assert metrics["rollout/step_group_share"] == pytest.approx(sum(n for n in sizes.values() if n > 1) / len(keys))
    assert metrics["rollout/step_group_size"] == pytest.approx(len(keys) / len(sizes))
    assert metrics["rollout/step_group_share"] >= 0.5  # the start, at least three times


def _sample(turns, group_id, state_keys, length_per_turn=4):
    """A hand-made trajectory: a 3-token prompt, then per turn `length_per_turn` generated tokens (the
    last is the turn end, holding the reward) and a 2-token observation."""
    layout = []
    for _ in turns:
        layout += [0, 0] + [1] * length_per_turn
    layout = [0] + layout
    length = len(layout)
    loss_mask = torch.tensor(layout, dtype=torch.float)
    ends = [i for i in range(length) if layout[i] and (i + 1 == length or not layout[i + 1])]
    turn_end_mask = torch.zeros(length)
    token_rewards = torch.zeros(length)
    for end, reward in zip(ends, turns):
        turn_end_mask[end] = 1
        token_rewards[end] = reward
    sample = Sample(torch.arange(length), torch.arange(length), loss_mask, turn_end_mask, loss_mask.clone(),
                    torch.zeros(length), token_rewards, None, None, group_id, float(sum(turns)), 0,
                    state_keys=state_keys)
    sample.extra["old_logprobs"] = torch.zeros(length)
    sample.extra["entropies"] = torch.zeros(length)
    return sample


def test_compute_advantages_puts_each_turn_advantage_on_its_generated_tokens():
    from vagen.update import compute_advantages

    cfg = load_config("sokoban_text", ["algo.adv_estimator=gigpo", "algo.step_gamma=0.5", "algo.gigpo_norm=mean"])
    # group 7 of HAND_*: rows 0-2, with hashable keys of any kind in place of ids
    key = {A: ("room", 1), B: ("room", 2), C: "room three"}
    samples = [_sample([1.0, 3.0], 7, [key[A], key[B]]), _sample([0.0, 2.0], 7, [key[A], key[C]]),
               _sample([0.0, 0.0, 6.0], 7, [key[A], key[B], key[B]])]
    metrics = compute_advantages(samples, cfg)
    expected = [[5 / 6, -1], [-2 - 2 / 3, -2], [2 - 1 / 6, 1, 4]]
    for sample, per_turn in zip(samples, expected):
        advantages = sample.extra["advantages"]
        turn_of = torch.cumsum(sample.turn_end_mask, 0) - sample.turn_end_mask
        for k, value in enumerate(per_turn):
            tokens = (sample.loss_mask > 0) & (turn_of == k)
            assert tokens.sum() == 4
            torch.testing.assert_close(advantages[tokens], torch.full((4,), float(value)), rtol=0, atol=1e-6)
        assert (advantages[sample.loss_mask == 0] == 0).all()
        assert torch.equal(sample.extra["returns"], advantages)
    assert metrics["rollout/step_group_share"] == pytest.approx(6 / 7)
    assert metrics["rollout/step_group_size"] == pytest.approx(7 / 3)


def test_compute_advantages_refuses_turns_without_a_state_key():
    from vagen.update import compute_advantages

    cfg = load_config("sokoban_text", ["algo.adv_estimator=gigpo"])
    samples = [_sample([1.0, 0.0], 0, ["a", None]), _sample([0.0], 0, ["a"])]
    with pytest.raises(ValueError, match=r"trajectory 0 \(seed 0\) has 2 turns and state keys \['a', None\]; "
                                         r"every turn needs the environment's info\['state_key'\]"):
        compute_advantages(samples, cfg)


# ----------------------------------------------------------------------------- config and training


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["algo.adv_estimator=gigpo", "rollout.group_size=1"],
         r"algo.adv_estimator=gigpo compares rollouts within a group, but rollout.group_size=1; set "
         r"rollout.group_size=2 or more"),
        (["algo.step_gamma=1.2"], r"algo.step_gamma=1.2 must be in \[0, 1\]"),
        (["algo.step_weight=-0.5"], r"algo.step_weight=-0.5 must be a finite number >= 0"),
        (["algo.gigpo_norm=std"], r"algo.gigpo_norm='std' is not a valid choice; did you mean 'mean_std'\? "
                                  r"choices: mean_std, mean"),
        (["algo.adv_estimator=gigpo", "algo.kl_coef=0.05", "algo.kl_in_reward=true"],
         r"algo.adv_estimator=gigpo uses only each turn's reward, so the penalty would be ignored"),
        (["algo.adv_estimator=gipgo"], r"did you mean 'gigpo'.*choices: turn_gae, gae, grpo, gigpo"),
    ],
)
def test_config_errors_say_how_to_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("sokoban_visual", overrides)


def test_config_defaults():
    algo = load_config("sokoban_visual", ["algo.adv_estimator=gigpo"]).algo
    assert (algo.step_gamma, algo.step_weight, algo.gigpo_norm) == (0.95, 1.0, "mean_std")


FAST = ["train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false"]


def test_sokoban_visual_trains_one_iteration_with_gigpo_and_no_critic(tmp_path, model_cache, distributed):
    from vagen.train import main

    overrides = FAST + [f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}", "algo.adv_estimator=gigpo"]
    assert main(["--config", "sokoban_visual", *overrides]) == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("actor/pg_loss", "actor/grad_norm", "rollout/step_group_share", "rollout/step_group_size"):
        assert math.isfinite(record[key]), key
    assert 0.0 <= record["rollout/step_group_share"] <= 1.0 and record["rollout/step_group_size"] >= 1.0
    assert not any(key.startswith("critic/") for key in record)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert (ckpt / "actor").exists() and not (ckpt / "critic").exists()


def test_step_group_statistics_of_the_benchmark_on_a_hand_checked_case():
    from benchmark_scripts import load

    stats = load("step_groups").step_group_stats
    # level group 0: turns 0 share "a"; a later turn returns to "a"; "b" once. level group 1: "a" alone.
    turns = [(0, 0, "a"), (0, 0, "a"), (0, 1, "a"), (0, 1, "b"), (1, 0, "a")]
    out = stats(turns)
    assert out == {"turns": 5, "later_turns": 2, "share": 3 / 5, "size": 5 / 3, "later_share": 1 / 2}


def test_step_group_benchmark_groups_random_play_by_level_and_state():
    from benchmark_scripts import load

    from vagen.config import load_config

    bench = load("step_groups")
    cfg = load_config("frozenlake_visual")
    keyed = bench.random_turns(cfg, [3, 4], group_size=3)
    assert {group for group, _, _ in keyed} == {0, 1}
    assert [turn for _, turn, _ in keyed if turn == 0] == [0] * 6  # one first turn per rollout
    # every rollout of a level starts from its reset state: the first turns form one group per level
    assert len({(g, k) for g, t, k in keyed if t == 0}) == 2
    assert bench.random_turns(cfg, [3, 4], group_size=3) == keyed  # random actions drawn from (seed, member)
