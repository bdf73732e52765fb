import torch

from vagen.config import load_config
from vagen.episode import EVAL_SEED_BASE, ChatEncoder, eval_seeds, train_seeds
from vagen.rollout import rollout, rollout_metrics


def _cfg(*extra):
    return load_config("sokoban_text", ["rollout.max_new_tokens=8", "rollout.max_turns=3", *extra])


def test_training_and_evaluation_seeds_never_overlap():
    seen = {s for it in range(1000) for s in train_seeds(it, 8, base_seed=3)}
    assert len(seen) == 8000 and max(seen) < EVAL_SEED_BASE
    assert min(eval_seeds(64)) == EVAL_SEED_BASE


def test_groups_share_a_level_and_sampling_is_deterministic_by_seed(tiny_text):
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    cfg = _cfg()
    torch.manual_seed(0)
    first, _ = rollout(model, encoder, cfg, [11, 12], group_size=3)
    torch.manual_seed(0)
    again, _ = rollout(model, encoder, cfg, [11, 12], group_size=3)
    assert [ep.seed for ep in first] == [11, 11, 11, 12, 12, 12]
    assert [ep.group_id for ep in first] == [0, 0, 0, 1, 1, 1]
    assert [ep.input_ids for ep in first] == [ep.input_ids for ep in again]
    # the first observation (system prompt + level) is the same within a group
    prompt = [ep.input_ids[: ep.turns[0].span[0]] for ep in first]
    assert prompt[0] == prompt[1] == prompt[2] != prompt[3]
    suppressed = set(encoder.suppress_ids)
    for ep in first:
        for turn in ep.turns:
            generated = ep.input_ids[turn.span[0] : turn.span[1]]
            assert not suppressed & set(generated)
            assert generated[-1] == encoder.im_end_id and encoder.im_end_id not in generated[:-1]
            assert turn.response_length == len(generated) <= cfg.rollout.max_new_tokens + 1


def test_length_limit_drops_whole_turns_and_counts_them(tiny_text):
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    torch.manual_seed(1)
    full, _ = rollout(model, encoder, _cfg(), [5], group_size=1)
    first_turn_end = full[0].turns[0].span[1]
    # room for the first turn but not for a second one
    cfg = _cfg(f"rollout.max_trajectory_length={first_turn_end + 9}")
    torch.manual_seed(1)
    cut, _ = rollout(model, encoder, cfg, [5], group_size=1)
    episode = cut[0]
    assert len(episode.turns) == 1 and episode.truncated_by_length
    assert len(episode.input_ids) == episode.turns[0].span[1] <= cfg.rollout.max_trajectory_length
    assert rollout_metrics(cut)["rollout/truncated_trajectories"] == 1.0


def test_generate_ignores_the_checkpoints_own_generation_settings(tiny_text):
    """Published checkpoints carry sampling settings (Qwen2.5-VL: repetition_penalty 1.05) that
    transformers would apply to every option a call leaves unset; rollouts must sample as configured."""
    import copy

    from hf_generate import batch_generation_inputs, decode

    from vagen.decoding_hf import HFDecoder
    from vagen.episode import Episode

    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    episodes = []
    for text in ("Which way? Answer Left or Right.", "Push the box up."):
        episode = Episode("bandit", seed=0, group_id=0, system_prompt="Choose.")
        episode.input_ids, _, _ = encoder.user_segment(text, [], first=True, system="Choose.")
        episodes.append(episode)
    clean = decode(HFDecoder(model, encoder), episodes, [0, 1], 12, temperature=0.0)
    penalised = copy.deepcopy(model)
    penalised.generation_config.repetition_penalty = 50.0
    penalised.generation_config.no_repeat_ngram_size = 1
    assert decode(HFDecoder(penalised, encoder), episodes, [0, 1], 12, temperature=0.0) == clean
    assert penalised.generation_config.repetition_penalty == 50.0  # the checkpoint keeps its own settings
    # where transformers applies them, they change what this model decodes
    batch = batch_generation_inputs(encoder, episodes)
    with torch.no_grad():
        raw = penalised.generate(**batch, do_sample=False, max_new_tokens=12, pad_token_id=encoder.pad_id)
    width = batch["input_ids"].shape[1]
    assert [row[: len(new)] for row, new in zip(raw[:, width:].tolist(), clean)] != clean
