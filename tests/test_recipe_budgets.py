"""What a recipe leaves to the environment: every model recipe composed after every visual environment config
gets that environment's real-model turns, tokens per turn and trajectory length (its `real_model` section), and
for Qwen3-VL its 32-pixel geometry; the vagen-full preset over every model recipe; the reward-std filter at each
recipe's stated GPU count. The checks run with rollout.backend=hf: vLLM's absence from this environment is not
what they test."""

import re
import shlex

import pytest
import yaml

import envs_visual
from vagen.config import (
    CONFIGS_DIR,
    MODEL_FAMILIES,
    ConfigError,
    check_config,
    check_ranks,
    load_configs,
    to_yaml,
)

RECIPES = sorted(p.stem for p in (CONFIGS_DIR / "recipes").glob("*.yaml") if "\nfamily: " in p.read_text())
VISUAL = ["frozenlake_visual", "manipulation_visual", "navigation_visual", "sokoban_visual"]
HF = ["rollout.backend=hf"]

# (turns, new tokens per turn, trajectory length) of a real checkpoint in each environment, hand-copied from
# VAGEN's scripts (the files each environment config cites): Qwen2.5-VL's from its vagen-legacy branch, and
# Sokoban's for Qwen3-VL from its main branch's Qwen3-VL run; the other environments have no Qwen3-VL run.
BUDGETS = {
    ("sokoban_visual", "qwen2_vl"): (3, 200, 2400),  # vagen_full/sokoban/run.sh
    ("sokoban_visual", "qwen3_vl"): (5, 512, 5000),  # train_sokoban_free_wm.yaml; prompt 1000 + response 4000
    ("frozenlake_visual", "qwen2_vl"): (3, 200, 2400),  # vagen_base/frozenlake/run.sh
    ("frozenlake_visual", "qwen3_vl"): (3, 200, 2400),
    ("navigation_visual", "qwen2_vl"): (5, 256, 5000),  # vagen_base/navigation/run.sh
    ("navigation_visual", "qwen3_vl"): (5, 256, 5000),
    ("manipulation_visual", "qwen2_vl"): (3, 200, 3800),  # vagen_base/maniskill/run.sh
    ("manipulation_visual", "qwen3_vl"): (3, 200, 3800),
}


def _family(recipe: str) -> str:
    return yaml.safe_load((CONFIGS_DIR / "recipes" / f"{recipe}.yaml").read_text())["family"]


def _stated_gpus(recipe: str) -> int:
    header = (CONFIGS_DIR / "recipes" / f"{recipe}.yaml").read_text()
    return int(re.search(r"deepspeed --num_gpus (\d+) vagen/train.py", header).group(1))


def _budget(cfg) -> tuple[int, int, int]:
    return cfg.rollout.max_turns, cfg.rollout.max_new_tokens, cfg.rollout.max_trajectory_length


def test_the_recipes_families_are_vagen_models_families():
    from vagen.models.families import FAMILIES

    assert set(MODEL_FAMILIES) == {family.name for family in FAMILIES}
    assert {_family(recipe) for recipe in RECIPES} == {"qwen2_vl", "qwen3_vl"}


def test_the_issue_case_navigation_keeps_its_five_turns_and_gets_a_real_models_tokens():
    cfg = load_configs(["navigation_visual", "recipes/qwen2.5-vl-3b"], ["model.path=builtin:tiny-vl"])
    assert _budget(cfg) == (5, 256, 5000)
    printed = to_yaml(cfg, with_help=True)
    assert re.search(r"^  max_turns: 5 ", printed, re.M) and re.search(r"^  max_new_tokens: 256 ", printed, re.M)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("env", VISUAL)
def test_every_recipe_after_every_environment_keeps_that_environments_budgets(recipe, env):
    alone = load_configs([env])
    cfg = load_configs([env, f"recipes/{recipe}"], require_checkpoint=False)
    family = _family(recipe)
    assert _budget(cfg) == BUDGETS[env, family]
    # never the tiny model's tokens per turn, and the environment's own turns unless VAGEN's run of that
    # family in that environment plays more (Sokoban's Qwen3-VL run: 5)
    assert cfg.rollout.max_new_tokens >= 200 > alone.rollout.max_new_tokens
    assert cfg.rollout.max_turns == alone.rollout.max_turns or (env, family) == ("sokoban_visual", "qwen3_vl")
    # the environment's other keys are its own
    assert cfg.env.name == alone.env.name and cfg.env.max_actions_per_turn == alone.env.max_actions_per_turn
    assert cfg.env.prompt_format == alone.env.prompt_format
    # a vLLM engine accepts the longest trajectory
    assert cfg.vllm.max_model_len >= cfg.rollout.max_trajectory_length
    # the vagen-full preset after the recipe changes the method, not the budgets
    full = load_configs([env, f"recipes/{recipe}", "recipes/vagen-full"], require_checkpoint=False)
    assert _budget(full) == _budget(cfg)


@pytest.mark.parametrize("env", VISUAL)
@pytest.mark.parametrize("family, token_pixels", [("qwen2_vl", 28), ("qwen3_vl", 32)])
def test_frames_line_up_with_the_familys_image_tokens(env, family, token_pixels):
    """Each frame's sides are whole image tokens of the family (28 pixels for Qwen2.5-VL, 32 for Qwen3-VL), and
    model.min_pixels (Qwen3-VL's processor enlarges anything under 256 x 256) is the frame itself."""
    recipe = next(r for r in RECIPES if _family(r) == family)
    cfg = load_configs([env, f"recipes/{recipe}"], require_checkpoint=False)
    made = envs_visual.make(cfg.env.name, render_mode=cfg.env.render_mode, **cfg.env.params)
    try:
        obs, _ = made.reset(seed=0)
        (frame,) = obs.images
    finally:
        if hasattr(made, "close"):
            made.close()
    width, height = frame.size
    assert width % token_pixels == 0 and height % token_pixels == 0, (env, family, frame.size)
    if family == "qwen3_vl":
        assert cfg.model.min_pixels == width * height
    else:
        assert cfg.model.min_pixels is None
    if env == "sokoban_visual":  # one token per cell
        assert cfg.env.params["cell_size"] == token_pixels and width == 6 * token_pixels


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_passes_with_the_reward_std_filter_at_its_gpu_count(recipe):
    """The header's filter command where it gives one (32 level groups at 8 ranks), else the recipe as it is."""
    text = (CONFIGS_DIR / "recipes" / f"{recipe}.yaml").read_text()
    gpus = _stated_gpus(recipe)
    commands = re.findall(r"#   (deepspeed --num_gpus \d+ vagen/train\.py .*?)(?=\n#   \S|\n# [A-Z]|\n[a-z])",
                          text, flags=re.S)
    filtered = [" ".join(c.replace("\\\n#", " ").split()) for c in commands if "algo.filter_mode=std" in c]
    if filtered:
        (command,) = filtered
        overrides = [w for w in shlex.split(command) if "=" in w]
        assert overrides == ["algo.filter_mode=std", "rollout.env_groups=32"], command
    else:
        assert "algo.filter_mode=std" in text and "as it is" in text
        overrides = ["algo.filter_mode=std"]
    cfg, _ = check_config(["sokoban_visual", f"recipes/{recipe}"], [*overrides, *HF], gpus)
    assert cfg.algo.filter_mode == "std"
    # without the stated env_groups the filter keeps fewer groups than ranks
    if filtered:
        plain = load_configs(["sokoban_visual", f"recipes/{recipe}"], ["algo.filter_mode=std"],
                             require_checkpoint=False)
        with pytest.raises(ConfigError, match=f"keeps 4 of rollout.env_groups=16 level groups, fewer than the "
                                              f"{gpus} ranks"):
            check_ranks(plain, gpus)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipes_evaluate_before_training_on_at_least_128_levels(recipe):
    cfg = load_configs(["sokoban_visual", f"recipes/{recipe}"], require_checkpoint=False)
    assert cfg.eval.before_training and cfg.eval.episodes >= 128 and cfg.eval.every == 20
    assert cfg.rollout.backend == "vllm"


def test_qwen3_vl_recipes_are_vagens_qwen3_vl_run():
    for recipe in [r for r in RECIPES if r.startswith("qwen3-vl")]:
        cfg = load_configs(["sokoban_visual", f"recipes/{recipe}"], require_checkpoint=False)
        # GRPO, 32 levels x 8, KL 0, entropy 0, one optimizer step of 256 trajectories, 5 turns x 512 tokens
        assert (cfg.algo.adv_estimator, cfg.rollout.env_groups, cfg.rollout.group_size) == ("grpo", 32, 8)
        assert (cfg.algo.kl_coef, cfg.algo.entropy_coef, cfg.algo.token_selection) == (0.0, 0.0, "all")
        assert (cfg.train.mini_batch_size, cfg.train.iterations, cfg.train.save_every) == (256, 401, 100)
        assert _budget(cfg) == (5, 512, 5000) and cfg.eval.episodes == 256
    # VAGEN's own Qwen3-VL run used 4 GPUs
    assert _stated_gpus("qwen3-vl-4b") == 4


@pytest.mark.parametrize("recipe", RECIPES)
def test_vagen_full_over_each_recipe(recipe):
    cfg = load_configs(["sokoban_visual", f"recipes/{recipe}", "recipes/vagen-full"], require_checkpoint=False)
    assert cfg.env.prompt_format == "grounding_worldmodeling" and cfg.algo.state_reward == "rules"
    assert (cfg.rollout.env_groups, cfg.rollout.group_size, cfg.train.mini_batch_size) == (128, 1, 32)
    assert (cfg.algo.adv_estimator, cfg.algo.token_selection, cfg.algo.gamma_turn) == ("turn_gae", "all", 0.95)
    assert (cfg.algo.kl_coef, cfg.algo.kl_in_reward, cfg.algo.kl_kind) == (0.001, True, "k1")
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.rollout.top_p) == (0.2, 0.2, 1.0)
    # the model recipe's model, learning rates and LoRA stay
    model = load_configs(["sokoban_visual", f"recipes/{recipe}"], require_checkpoint=False)
    assert (cfg.model, cfg.train.actor_lr, cfg.train.deepspeed_config) == \
        (model.model, model.train.actor_lr, model.train.deepspeed_config)
    overrides = HF + (["train.deepspeed_config=deepspeed/zero3_bf16.json"] if recipe == "qwen3-vl-8b" else [])
    check_config(["sokoban_visual", f"recipes/{recipe}", "recipes/vagen-full"], overrides, _stated_gpus(recipe))
    # the faithful state reward: a local judge, refused without its checkpoint
    with pytest.raises(ConfigError, match="algo.state_reward=judge scores descriptions with a local causal LM"):
        load_configs(["sokoban_visual", f"recipes/{recipe}", "recipes/vagen-full"], ["algo.state_reward=judge"],
                     require_checkpoint=False)


def test_a_recipe_after_a_config_without_real_model_budgets_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe .*qwen2.5-vl-3b.yaml takes a real checkpoint's turns and lengths "
                                          r"from the environment config before it, but bandit_text has no "
                                          r"real_model section"):
        load_configs(["bandit_text", "recipes/qwen2.5-vl-3b"], require_checkpoint=False)
    # a recipe alone, or before the environment config, composes over what comes before it
    assert load_configs(["recipes/qwen2.5-vl-3b", "sokoban_visual"]).rollout.max_new_tokens == 64
    partial = tmp_path / "partial.yaml"
    partial.write_text("env:\n  name: sokoban\nreal_model:\n  rollout:\n    max_turns: 4\n")
    with pytest.raises(ConfigError, match="does not set rollout.max_new_tokens, rollout.max_trajectory_length"):
        load_configs([str(partial), "recipes/qwen2.5-vl-3b"], require_checkpoint=False)
    family = tmp_path / "family.yaml"
    family.write_text("family: qwen25_vl\nmodel:\n  dtype: bfloat16\n")
    with pytest.raises(ConfigError, match="family: 'qwen25_vl' in .* is not a model family; did you mean 'qwen2_vl'"):
        load_configs(["sokoban_visual", str(family)])
    # a user's own environment config brings its own budgets, and its family part applies to that family only
    own = tmp_path / "my_navigation.yaml"
    own.write_text((CONFIGS_DIR / "navigation_visual.yaml").read_text().replace("max_turns: 5                 #",
                                                                                  "max_turns: 7                 #"))
    assert load_configs([str(own), "recipes/qwen2.5-vl-7b"], require_checkpoint=False).rollout.max_turns == 7
    # overrides come after the budgets
    cfg = load_configs(["navigation_visual", "recipes/qwen3-vl-4b"], ["rollout.max_turns=2"], require_checkpoint=False)
    assert (cfg.rollout.max_turns, cfg.env.params["image_width"]) == (2, 128)


# Two iterations of VAGEN-Full on the shipped tiny Qwen2.5-VL warm start took 104 s on a loaded 2-core machine: slow.
@pytest.mark.slow
def test_vagen_full_trains_two_iterations_with_a_tiny_model(tmp_path, model_cache, distributed):
    """grounding_worldmodeling graded by the rules, KL (k1) in the reward of turn-level GAE, groups of one,
    the evaluation before training: the preset's keys run together."""
    import json

    from vagen.train import main

    overrides = ["model.path=assets:sokoban_visual", "rollout.backend=hf", "model.dtype=float32",
                 "train.deepspeed_config=deepspeed/zero0_fp32.json", "train.iterations=2", "rollout.env_groups=4",
                 "rollout.max_new_tokens=24", "rollout.max_turns=2", "train.mini_batch_size=4",
                 "train.micro_batch_size=2", "eval.episodes=2", "eval.videos=0", "log.progress=false",
                 f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}"]
    assert main(["--config", "sokoban_visual", "--config", "recipes/qwen2.5-vl-3b", "--config", "recipes/vagen-full",
                 *overrides]) == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [-1, 0, 1] and records[0]["eval/episodes"] == 2
    assert "actor/kl_to_ref" in records[-1] and "actor/kl_loss" not in records[-1]
    assert "critic/vf_loss" in records[-1] and "rollout/grounding_score" in records[-1]
    saved = load_configs([str(run / "config.yaml")])
    assert saved.env.prompt_format == "grounding_worldmodeling" and saved.rollout.group_size == 1
