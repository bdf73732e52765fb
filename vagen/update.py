"""One StarPO/TRICO update over a batch of trajectories: annotate them with the old policy's
log-probabilities, entropies, values and reference log-probabilities, compute advantages, then run
PPO epochs of mini-batches (gradient accumulation over micro-batches) on the actor and critic.

The engines passed in are anything with `__call__` (forward), `backward(loss)`, `step()` and
`set_gradient_accumulation_boundary(b)`: DeepSpeed engines in training (built by `vagen/train.py`),
which own the optimizer, scheduler and gradient clipping; the boundaries are set here. Which samples
form each mini-batch and micro-batch is planned in `vagen.batch_plan`; this module runs the plan.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from dataclasses import dataclass

import torch

from vagen import core
from vagen.batch_plan import MiniBatch, micro_batch_tokens, plan_epoch, synced_micro_batches, trajectory_rows
from vagen.distributed import all_reduce, gathered, partitioned_over_ranks
from vagen.models import forward_packed, forward_shared_prefix
from vagen.trajectory import Sample, collate, model_inputs

# Rows of [positions, vocab] logits that `head_logprobs` computes at once: 1/32 of the positions, and no
# more than keep a chunk's float32 [rows, vocab] tensors within HEAD_CHUNK_BYTES. A chunk's backward holds
# about four of them at once (its recomputed logits, softmax and their gradients). Measured on 1,024
# positions of a 151,936-entry vocabulary (tests/memory_worker.py): the step's peak rose 0.52x one bf16
# logits tensor of all positions with 1/32, 1.85x with 1/8, and 14.5x when the whole logits were computed
# at once. The byte budget bounds long batches: 1/32 of 32,768 positions would be 1,024 rows, 0.6 GB a
# tensor at that vocabulary, where the budget allows 110 rows.
HEAD_CHUNK_FRACTION = 32
HEAD_CHUNK_BYTES = 256 * 2**20
HEAD_CHUNK_TENSORS = 4


def head_chunk_rows(rows: int, vocab: int) -> int:
    """Rows of logits `head_logprobs` computes at once for `rows` positions of a `vocab`-entry head."""
    budget = HEAD_CHUNK_BYTES // (HEAD_CHUNK_TENSORS * 4 * vocab)
    return max(1, min(-(-rows // HEAD_CHUNK_FRACTION), budget))


def _head_logits(lm_head, hidden: torch.Tensor) -> torch.Tensor:
    """`lm_head(hidden)`. A frozen head whose parameters ZeRO-3 partitions (LoRA) is applied through
    detached aliases of its parameters, gathered for the call.

    Why: with gradients, backward recomputes each chunk (torch's non-reentrant checkpoint), and the
    recompute keeps a frozen tensor it saves as that very tensor (a trained one as a detached alias). The
    head's ZeRO-3 hooks partition its parameters again when the recomputed call returns, which empties
    them in place (`param.data` becomes a 0-element tensor), so the saved weight would be empty by the
    time the chunk's backward reads it (torch's checkpoint refuses it: "Recomputed values ... have
    different metadata"). DeepSpeed keeps such a parameter gathered until the backward of the module it
    is recomputed for ends, but the head runs after the engine's forward, outside every module whose
    backward is running. An alias keeps the gathered values alive until the chunk's backward is done and
    no longer, as torch's checkpoint does for a trained head: one gathered head at a time, forward or
    backward."""
    params = list(lm_head.parameters())
    # A parameter ZeRO-3 persists (`stage3_param_persistence_threshold`) is released too until its trace of
    # the model's calls is complete.
    if not any(hasattr(p, "ds_id") for p in params) or any(p.requires_grad for p in params):
        return lm_head(hidden)
    with gathered(params):
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
        return torch.nn.functional.linear(hidden, lm_head.weight.detach(), bias)


def _head_chunk(lm_head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                suppress: torch.Tensor | None):
    logits = _head_logits(lm_head, hidden).float()
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = core.logprobs_from_logits(logits[None], targets[None])[0]
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, core.entropy_from_logits(logits[None])[0]


def head_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                  chunk_rows: int | None = None, suppress: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities and entropies [P] of `targets` [P] under `lm_head(hidden)` [P, V], a chunk of
    rows at a time. With gradients each chunk is checkpointed: its logits are freed after the forward
    and recomputed in backward, so the full [P, V] logits never exist (151,936 vocabulary entries per
    position for Qwen2.5-VL)."""
    rows = hidden.shape[0]
    # Under ZeRO-3 over several ranks each call of the head gathers its weight collectively: every rank
    # runs as many chunks as the busiest (empty ones included), whatever its own number of positions.
    lockstep = partitioned_over_ranks(lm_head)
    if rows == 0 and not lockstep:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    vocab = getattr(lm_head, "out_features", None) or lm_head.weight.shape[0]  # a ZeRO-3 partition has no shape
    size = max(1, chunk_rows or head_chunk_rows(rows, vocab))
    count = -(-rows // size)
    if lockstep:
        count = int(all_reduce(torch.tensor([count], dtype=torch.float64), "max")[0])
    logprobs, entropies = [], []
    for start in range(0, count * size, size):
        part = (hidden[start : start + size], targets[start : start + size])
        if torch.is_grad_enabled():
            lp, ent = torch.utils.checkpoint.checkpoint(_head_chunk, lm_head, *part, temperature, with_entropy,
                                                        suppress, use_reentrant=False)
        else:
            lp, ent = _head_chunk(lm_head, *part, temperature, with_entropy, suppress)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool, suppress_ids=(),
                   packed: bool = False):
    """Log-probabilities [B, L] of the generated tokens of `batch` (on the model's device) given
    their prefix, and optionally the entropy of the distribution each was drawn from. Only the
    positions of generated tokens are computed (they are all that is trained); the rest are 0.
    Logits are divided by the sampling temperature so that ratios compare the distributions that
    were actually sampled. `packed`: the forward runs the rows back to back in one (`forward_packed`)."""
    input_ids = batch["input_ids"]
    module = getattr(model, "module", model)
    forward = forward_packed if packed else forward_shared_prefix
    hidden = forward(model, model_inputs(batch), final_hidden=True)
    rows, positions = batch["loss_mask"][:, 1:].nonzero(as_tuple=True)  # position t predicts token t + 1
    suppress = torch.tensor(list(suppress_ids), dtype=torch.long, device=hidden.device) if len(suppress_ids) else None
    lp, ent = head_logprobs(module.get_output_embeddings(), hidden[rows, positions],
                            input_ids[rows, positions + 1], temperature, with_entropy, suppress=suppress)
    logprobs = torch.zeros(input_ids.shape, device=hidden.device)
    logprobs = logprobs.index_put((rows, positions + 1), lp)
    entropies = None
    if with_entropy:
        entropies = torch.zeros(input_ids.shape, device=hidden.device).index_put((rows, positions + 1), ent)
    return logprobs, entropies


@torch.no_grad()
def annotate(samples: list[Sample], actor, critic, reference, cfg, pad_id: int, device, suppress_ids=()) -> None:
    """Store old_logprobs, entropies, values (with a critic) and ref_logprobs (with a reference) on
    each sample's `extra`, trimmed to the sample's length. `suppress_ids`: token ids the rollout never
    samples, left out of the log-probabilities' support (`head_logprobs`)."""
    temperature, packed = cfg.rollout.temperature, cfg.train.pack_sequences
    for indices in synced_micro_batches(samples, cfg.train):
        group = [samples[i] for i in (indices if indices is not None else [0])]
        batch = {k: v.to(device) for k, v in collate(group, pad_id).items()}
        logprobs, entropies = token_logprobs(actor, batch, temperature, with_entropy=True, suppress_ids=suppress_ids,
                                             packed=packed)
        results = {"old_logprobs": logprobs, "entropies": entropies}
        if critic is not None:
            results["old_values"] = critic(**model_inputs(batch), packed=packed).float()
        if reference is not None:
            results["ref_logprobs"], _ = token_logprobs(reference, batch, temperature, with_entropy=False,
                                                        suppress_ids=suppress_ids, packed=packed)
        if indices is None:
            continue
        for row, sample in enumerate(group):
            for name, value in results.items():
                sample.extra[name] = value[row, : sample.length].cpu()


@dataclass
class Trajectory:
    """What the estimators read of a trajectory besides its tokens (a sample is one, with rollout.context=full)."""

    group_id: int
    score: float
    seed: int
    state_keys: list | None
    task: str = ""


class TrajectoryLayout:
    """Maps a batch of samples [S, L] to one row per trajectory [T, N] holding the generated tokens of its
    samples in order, and back. With rollout.context=window a trajectory's turns are separate samples; laid
    out as one row they are exactly the generated tokens of the trajectory's single sequence in full mode,
    so every estimator (per-trajectory GRPO and GiGPO, turn-level and token-level GAE over the trajectory's
    tokens, per-trajectory entropy selection) computes the same thing in both modes. With one sample per
    trajectory the layout is the identity."""

    def __init__(self, samples: list[Sample], loss_mask: torch.Tensor):
        self.rows = trajectory_rows(samples)
        self.identity = all(len(row) == 1 for row in self.rows) and all(s.turn_index is None for s in samples)
        self.trajectories = [Trajectory(samples[row[0]].group_id, samples[row[0]].score, samples[row[0]].seed,
                                        [key for i in row for key in (samples[i].state_keys or [])],
                                        samples[row[0]].task) for row in self.rows]
        if self.identity:
            return
        src_rows, src_cols, dst_rows, dst_cols = [], [], [], []
        for t, row in enumerate(self.rows):
            offset = 0
            for i in row:
                cols = (loss_mask[i] != 0).nonzero(as_tuple=True)[0]
                src_rows.append(torch.full_like(cols, i))
                src_cols.append(cols)
                dst_rows.append(torch.full_like(cols, t))
                dst_cols.append(torch.arange(offset, offset + cols.numel()))
                offset += cols.numel()
        self.src = (torch.cat(src_rows), torch.cat(src_cols))
        self.dst = (torch.cat(dst_rows), torch.cat(dst_cols))
        self.shape = (len(self.rows), int(self.dst[1].max()) + 1 if self.dst[1].numel() else 0)
        self.sample_shape = tuple(loss_mask.shape)

    def gather(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The per-token [S, L] entries of `batch` as [T, N] trajectory rows (0 past a row's tokens)."""
        if self.identity:
            return batch
        out = {}
        for name, value in batch.items():
            if value.dim() == 2 and tuple(value.shape) == self.sample_shape:
                rows = torch.zeros(self.shape, dtype=value.dtype)
                rows[self.dst] = value[self.src]
                out[name] = rows
        return out

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, N] trajectory rows back to the samples' [S, L] (0 at tokens that are not generated)."""
        if self.identity:
            return rows
        out = torch.zeros(self.sample_shape, dtype=rows.dtype)
        out[self.src] = rows[self.dst]
        return out


def compute_advantages(samples: list[Sample], cfg) -> dict[str, float]:
    """Advantages, returns and the adv_mask of every sample, from its rewards and old values; estimated over
    whole trajectories (`TrajectoryLayout`) whether a sample is one or one of its turns."""
    algo = cfg.algo
    fields = ["old_logprobs", "entropies"] + (["old_values"] if "old_values" in samples[0].extra else [])
    fields += ["ref_logprobs"] if "ref_logprobs" in samples[0].extra else []
    fields += ["rollout_logprobs"] if "rollout_logprobs" in samples[0].extra else []
    sample_batch = collate(samples, pad_id=0, fields=tuple(fields), with_images=False)
    metrics = {}
    if "rollout_logprobs" in sample_batch:
        metrics.update(rollout_correction(samples, sample_batch, algo))
    layout = TrajectoryLayout(samples, sample_batch["loss_mask"])
    batch, trajectories = layout.gather(sample_batch), layout.trajectories
    loss_mask, sampled_mask = batch["loss_mask"], batch["sampled_mask"]
    rewards = batch["token_rewards"]
    if "ref_logprobs" in batch:
        kl = core.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_kind) * sampled_mask
        metrics["actor/kl_to_ref"] = float(kl.sum() / sampled_mask.sum().clamp(min=1))
        if algo.kl_in_reward:
            rewards = rewards - algo.kl_coef * kl
    if algo.adv_estimator == "grpo":
        scores = torch.tensor([t.score for t in trajectories])
        group_ids = torch.tensor([t.group_id for t in trajectories])
        per_traj = core.grpo_advantages(scores, group_ids, norm_by_std=algo.grpo_norm_by_std)
        advantages = per_traj[:, None] * loss_mask
        returns = advantages
    elif algo.adv_estimator == "gae":
        advantages, returns = core.gae(rewards, batch["old_values"], loss_mask, algo.gamma, algo.lam)
    elif algo.adv_estimator == "turn_gae":
        advantages, returns = core.turn_level_gae(rewards, batch["old_values"], loss_mask, batch["turn_end_mask"],
                                                  algo.gamma_turn, algo.lam_turn, algo.gamma, algo.lam)
    elif algo.adv_estimator == "gigpo":
        advantages, step_metrics = gigpo_token_advantages(trajectories, batch, algo)
        returns = advantages
        metrics.update({f"rollout/{name}": value for name, value in step_metrics.items()})
    else:
        raise ValueError(f"unknown algo.adv_estimator {algo.adv_estimator!r}; choices: turn_gae, gae, grpo, gigpo")
    if algo.whiten_advantages and algo.adv_estimator not in ("grpo", "gigpo"):
        # over every rank's batch, as one process with the whole batch would; per task with rollout.tasks
        advantages = whiten_by_task(advantages, loss_mask, [t.task for t in trajectories],
                                    [task.name for task in cfg.rollout.tasks])
    # Only tokens the policy drew get policy gradient: an appended <|im_end|> keeps its advantage (the
    # turn's value and reward sit there) but is out of adv_mask.
    adv_mask = core.select_critical_tokens(sampled_mask, batch["answer_mask"], batch["think_mask"],
                                           batch["entropies"], algo.token_selection, algo.top_ratio)
    selected = adv_mask.sum()
    metrics["actor/selected_token_ratio"] = float(selected / sampled_mask.sum().clamp(min=1))
    metrics["actor/advantage_mean"] = float((advantages * loss_mask).sum() / loss_mask.sum().clamp(min=1))
    advantages, returns, adv_mask = (layout.scatter(x) for x in (advantages, returns, adv_mask))
    for row, sample in enumerate(samples):
        n = sample.length
        sample.extra["advantages"] = advantages[row, :n]
        sample.extra["returns"] = returns[row, :n]
        sample.extra["adv_mask"] = adv_mask[row, :n]
    return metrics


def whiten_by_task(advantages: torch.Tensor, loss_mask: torch.Tensor, tasks: list[str], names: list[str],
                   reduce=all_reduce) -> torch.Tensor:
    """`core.masked_whiten` over every rank's batch ([T, N] rows, `tasks` the T rows' task names), within each
    task of `names` (rollout.tasks, the same list on every rank, so that each rank joins the same reductions
    even where it holds no row of a task): each task's advantages get mean 0 and variance 1 of their own, so
    that no task's reward scale sets another's step size. `names` empty: over the whole batch."""
    if not names:
        return core.masked_whiten(advantages, loss_mask, reduce=reduce)
    out = torch.zeros_like(advantages)
    for name in names:
        rows = torch.tensor([task == name for task in tasks], dtype=torch.bool)[:, None]
        mask = loss_mask * rows.to(loss_mask.dtype)
        out = out + core.masked_whiten(advantages, mask, reduce=reduce)
    return out


def gigpo_token_advantages(samples: list[Trajectory], batch: dict[str, torch.Tensor], algo):
    """`core.gigpo_advantages` over the turns of the batch's trajectories (each turn's reward sits at its turn
    end; its anchor state is the trajectory's `state_keys` entry), each turn's advantage placed on every
    generated token of that turn. Returns ([B, L] advantages, the step-group metrics)."""
    row, col, k, counts, n_turns = core.compact_index(batch["turn_end_mask"] != 0)  # turn k of row ends at col
    shape = (len(samples), n_turns)
    turn_rewards = torch.zeros(shape, dtype=torch.float64)
    turn_rewards[row, k] = batch["token_rewards"][row, col].to(torch.float64)
    turn_mask = torch.arange(shape[1])[None, :] < counts[:, None]
    ids: dict = {}  # anchor state key -> int id; only equality within a level group matters
    state_ids = torch.zeros(shape, dtype=torch.long)
    for i, sample in enumerate(samples):
        keys = sample.state_keys or []
        if len(keys) != int(counts[i]) or any(key is None for key in keys):
            raise ValueError(
                f"algo.adv_estimator=gigpo groups turns by the state they start from, but trajectory {i} (seed "
                f"{sample.seed}) has {int(counts[i])} turns and state keys {reprlib.repr(keys)}; every turn needs the "
                f"environment's info['state_key'] (TextActionEnv.state_key(), recorded by vagen.rollout as "
                f"Turn.state_key); give the environment a state() or a state_key(), or use algo.adv_estimator=grpo")
        state_ids[i, : len(keys)] = torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.long)
    group_ids = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    per_turn, metrics = core.gigpo_advantages(turn_rewards, turn_mask, group_ids, state_ids, algo.step_gamma,
                                              algo.step_weight, algo.gigpo_norm)
    if shape[1] == 0:
        return torch.zeros_like(batch["loss_mask"]), metrics
    # Token t belongs to the turn whose end is the first turn end at or after t.
    ends = (batch["turn_end_mask"] != 0).long()
    turn_of_token = (torch.cumsum(ends, dim=1) - ends).clamp(max=shape[1] - 1)
    advantages = per_turn.to(batch["loss_mask"].dtype).gather(1, turn_of_token) * batch["loss_mask"]
    return advantages, metrics


def rollout_correction(samples: list[Sample], batch: dict[str, torch.Tensor], algo) -> dict[str, float]:
    """The gap between the engine that sampled (vLLM) and the trainer over the sampled tokens, as
    `rollout/inference_logprob_gap` (mean |difference|) and `_max`; with `algo.rollout_correction=tis`
    each sample's `tis_weights`, the importance weight w = p_trainer / p_engine per sampled token that its
    policy loss is multiplied by, above the cap C = `algo.rollout_correction_cap` clamped to C
    (`algo.rollout_correction_mode=clamp`, truncated importance sampling as in verl) or set to 0, the token left
    out of the loss (`mask`, AReaL's decoupled PPO: its `behav_imp_weight_cap`; the loss's denominator still
    counts the token), and `actor/tis_clamped_fraction`, the share of sampled tokens whose weight exceeded the
    cap. Old log-probs stay the trainer's, as in verl.

    This is AReaL's decoupled PPO objective, which `rollout.max_staleness` > 0 needs: the old log-probs are
    computed at the update, by the policy being updated (the proximal policy: the PPO ratio and its clip are
    taken against it), and the engine's are those of the policy that sampled each turn, possibly k updates
    older (the behaviour policy), so the weight corrects for the staleness and for the engines' gap at
    once. AReaL masks above the cap by default; vagen's default, clamp, keeps those tokens at weight C. At k = 0, with an engine that computes the trainer's own log-probabilities, every weight is 1."""
    mask = batch["sampled_mask"] > 0
    diff = (batch["old_logprobs"] - batch["rollout_logprobs"])[mask]
    metrics = {"rollout/inference_logprob_gap": float(diff.abs().mean()) if diff.numel() else 0.0,
               "rollout/inference_logprob_gap_max": float(diff.abs().max()) if diff.numel() else 0.0}
    if algo.rollout_correction == "tis":
        weights = torch.exp((batch["old_logprobs"] - batch["rollout_logprobs"]).clamp(max=20.0))
        clamped = (weights > algo.rollout_correction_cap) & mask
        if algo.rollout_correction_mode == "mask":
            weights = torch.where(clamped, torch.zeros_like(weights), weights) * mask
        elif algo.rollout_correction_mode == "clamp":
            weights = weights.clamp(max=algo.rollout_correction_cap) * mask
        else:
            raise ValueError(f"unknown algo.rollout_correction_mode {algo.rollout_correction_mode!r}; choices: "
                             f"clamp, mask")
        for row, sample in enumerate(samples):
            sample.extra["tis_weights"] = weights[row, : sample.length]
        metrics["actor/tis_weight_mean"] = float(weights[mask].mean()) if mask.any() else 1.0
        metrics["actor/tis_clamped_fraction"] = float(clamped.sum() / mask.sum()) if mask.any() else 0.0
    return metrics


def loss_norm_tokens(cfg) -> int:
    """N of seq-mean-token-sum-norm: `algo.loss_norm_tokens`, or the most tokens a trajectory can generate."""
    return cfg.algo.loss_norm_tokens or cfg.rollout.max_turns * (cfg.rollout.max_new_tokens + 1)


class UpdateStats:
    """Metrics of one `ppo_update`: means per micro-batch, per-mini-batch losses summed over ranks, and
    the optimizer steps skipped for a non-finite gradient."""

    def __init__(self, bad_steps_in_a_row: int):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.minibatch_losses: dict[str, list[float]] = {}
        self.skipped_steps = {"actor": 0, "critic": 0}
        self.bad_steps_in_a_row = bad_steps_in_a_row

    def add(self, name: str, value) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)
        self.counts[name] = self.counts.get(name, 0) + 1

    def end_minibatch(self, losses: dict[str, float], skipped: dict[str, bool], norms: dict[str, float | None]):
        for name, value in losses.items():
            self.minibatch_losses.setdefault(name, []).append(value)
        for name, was_skipped in skipped.items():
            self.skipped_steps[name] += was_skipped
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if any(skipped.values()) else 0
        for name, value in norms.items():
            if value is not None and math.isfinite(float(value)):
                self.add(name, float(value))

    def metrics(self, update_actor: bool, with_critic: bool) -> dict[str, float]:
        metrics = {k: self.sums[k] / self.counts[k] for k in self.sums}
        # Each rank holds its share of every mini-batch's loss: the sums over ranks are the mini-batch losses.
        names = sorted(self.minibatch_losses)
        if names:
            totals = all_reduce(torch.tensor([self.minibatch_losses[n] for n in names], dtype=torch.float64), "sum")
            for name, total in zip(names, totals):
                finite = total[torch.isfinite(total)]
                metrics[name] = float(finite.mean()) if finite.numel() else float("nan")
        if update_actor:
            metrics["actor/skipped_steps"] = float(self.skipped_steps["actor"])
        if with_critic:
            metrics["critic/skipped_steps"] = float(self.skipped_steps["critic"])
        metrics["update/bad_steps_in_a_row"] = float(self.bad_steps_in_a_row)
        return metrics


def ppo_update(actor_engine, critic_engine, samples: list[Sample], cfg, pad_id: int, device, world_size: int = 1,
               generator: torch.Generator | None = None, update_actor: bool = True,
               shuffle: bool = True, bad_steps_in_a_row: int = 0, suppress_ids=()) -> dict[str, float]:
    """PPO epochs over `samples` (this rank's share) with exactly one optimizer step per mini-batch.

    Each rank cuts its shuffled samples into mini-batches of `train.mini_batch_size / ranks`; the
    global mini-batch m is the union of every rank's m-th (`plan_epoch`). Its gradient is that of the
    mini-batch's loss under `algo.loss_agg` over all of it: every micro-batch divides its sum by the
    mini-batch's global denominator (`core.loss_denominator`, all-reduced), the loss is multiplied by
    the world size because DeepSpeed averages gradients over ranks, and DeepSpeed's own division by its
    accumulation steps is off. The optimizer steps at the last micro-batch of each mini-batch, which is
    set explicitly, whatever the micro-batch counts. Ranks with fewer micro-batches (or mini-batches)
    run passes of loss 0, so collective operations of ZeRO-2/3 pair up.

    A step whose gradient is not finite (a NaN or inf loss included) is skipped on every rank and
    leaves the weights as they were (`_step`); `actor/skipped_steps` and `critic/skipped_steps` count
    them, and `update/bad_steps_in_a_row` continues `bad_steps_in_a_row` (the count at the end of the
    previous call) with this call's trailing run of mini-batches where an engine skipped. Returns mean
    metrics; the losses of skipped mini-batches are left out of their means. `suppress_ids`: token ids
    the rollout never samples, left out of the log-probabilities' support (`head_logprobs`)."""
    algo = cfg.algo
    fields = ("old_logprobs", "advantages", "adv_mask", "returns")
    fields += ("old_values",) if critic_engine is not None else ()
    fields += ("ref_logprobs",) if (algo.kl_coef > 0 and not algo.kl_in_reward) else ()
    fields += ("tis_weights",) if samples and "tis_weights" in samples[0].extra else ()
    actor = actor_engine if update_actor else None
    stats = UpdateStats(bad_steps_in_a_row)
    passes, real_tokens, run_tokens, steps = 0, 0, 0, 0
    for _ in range(cfg.train.ppo_epochs):
        for mini in plan_epoch(samples, cfg, world_size, generator, shuffle):
            for indices in mini.micro:
                passes += 1
                lengths = [samples[i].length for i in indices or []]
                real_tokens += sum(lengths)
                run_tokens += micro_batch_tokens(lengths, cfg.train.pack_sequences)
            stats.end_minibatch(*train_minibatch(actor, critic_engine, samples, mini, cfg, pad_id, device, world_size,
                                                 fields, stats, suppress_ids))
            steps += 1
    metrics = stats.metrics(update_actor, critic_engine is not None)
    # this rank's forward/backward passes, and the share of the tokens they ran that were padding
    metrics["update/micro_batches"] = float(passes)
    metrics["update/padding_fraction"] = 1.0 - real_tokens / run_tokens if run_tokens else 0.0
    # the same on every rank (mini-batch counts are the busiest rank's), and what train.warmup_steps and
    # train.lr_decay_steps count
    metrics["update/optimizer_steps"] = float(steps)
    if critic_engine is not None:
        metrics["critic/explained_var"] = explained_variance(samples)
    return metrics


def train_minibatch(actor_engine, critic_engine, samples: list[Sample], mini: MiniBatch, cfg, pad_id: int, device,
                    world_size: int, fields: tuple[str, ...], stats: UpdateStats, suppress_ids=()):
    """Backward every micro-batch of `mini` and step the engines at its last; returns the mini-batch's
    losses (this rank's part), whether each engine skipped its step, and the gradient norms."""
    algo = cfg.algo
    norm = {"norm_tokens": loss_norm_tokens(cfg), "agg": algo.loss_agg}
    engines = [e for e in (actor_engine, critic_engine) if e is not None]
    losses = dict.fromkeys(["actor/pg_loss", "actor/entropy"] * (actor_engine is not None) + ["actor/kl_loss"] * (
        actor_engine is not None and "ref_logprobs" in fields) + ["critic/vf_loss"] * (critic_engine is not None), 0.0)
    skipped: dict[str, bool] = {}
    norms: dict[str, float | None] = {}
    for k, indices in enumerate(mini.micro):
        padding = indices is None
        if padding and not samples:
            raise RuntimeError("this rank holds no trajectory while others do; keep at least one level group per rank")
        weight = 0.0 if padding else float(world_size)
        boundary = k == len(mini.micro) - 1
        for engine in engines:
            engine.set_gradient_accumulation_boundary(boundary)
        batch = collate([samples[i] for i in (indices if not padding else [0])], pad_id, fields)
        batch = {key: v.to(device) for key, v in batch.items()}
        if actor_engine is not None:
            loss, parts, pg_metrics = actor_loss(actor_engine, batch, mini, cfg, norm, suppress_ids)
            actor_engine.backward(loss * weight, scale_wrt_gas=False)
            norms["actor/grad_norm"], skipped["actor"] = _step(actor_engine, boundary)
            if not padding:
                for name, value in parts.items():
                    losses[name] += value
                for key, value in pg_metrics.items():
                    stats.add(f"actor/{key}", value)
        if critic_engine is not None:
            values = critic_engine(**model_inputs(batch), packed=cfg.train.pack_sequences)
            vf_loss, vf_metrics = core.value_loss(values, batch["old_values"], batch["returns"], batch["loss_mask"],
                                                  clip=algo.value_clip, denominator=mini.value_den, **norm)
            critic_engine.backward(algo.vf_coef * vf_loss * weight, scale_wrt_gas=False)
            norms["critic/grad_norm"], skipped["critic"] = _step(critic_engine, boundary)
            if not padding:
                losses["critic/vf_loss"] += vf_loss.item()
                for key, value in vf_metrics.items():
                    stats.add(f"critic/{key}", value)
    return losses, skipped, norms


def actor_loss(actor_engine, batch: dict[str, torch.Tensor], mini: MiniBatch, cfg, norm: dict, suppress_ids=()):
    """The actor's loss on one micro-batch: clipped policy gradient - entropy bonus (+ KL to the
    reference); returns it, its parts as floats, and the policy-gradient metrics."""
    algo = cfg.algo
    sampled_mask = batch["sampled_mask"]
    logprobs, entropies = token_logprobs(actor_engine, batch, cfg.rollout.temperature, with_entropy=True,
                                         suppress_ids=suppress_ids, packed=cfg.train.pack_sequences)
    pg_loss, pg_metrics = core.ppo_policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], batch["adv_mask"], clip_low=algo.clip_low,
        clip_high=algo.clip_high, dual_clip=algo.dual_clip, denominator=mini.pg_den, weights=batch.get("tis_weights"),
        **norm)
    entropy = core.aggregate_loss(entropies, sampled_mask, algo.loss_agg, norm["norm_tokens"], mini.sampled_den)
    loss = pg_loss - algo.entropy_coef * entropy
    parts = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy.item()}
    if "ref_logprobs" in batch:
        kl = core.aggregate_loss(core.kl_penalty(logprobs, batch["ref_logprobs"], algo.kl_kind), sampled_mask,
                                 algo.loss_agg, norm["norm_tokens"], mini.sampled_den)
        loss = loss + algo.kl_coef * kl
        parts["actor/kl_loss"] = kl.item()
    return loss, parts, pg_metrics


@contextlib.contextmanager
def _no_update(engine):
    """`engine.step()` inside leaves the weights, the optimizer's state and the schedule as they were."""
    targets = [engine.optimizer] + ([engine.lr_scheduler] if engine.lr_scheduler is not None else [])
    for target in targets:
        target.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        for target in targets:
            del target.step


def _step(engine, boundary: bool) -> tuple[float | None, bool]:
    """`engine.step()`; at an accumulation boundary also the norm of the (data-parallel averaged)
    gradient before clipping, and whether the step was skipped because that gradient is not finite.

    Under ZeRO or mixed precision DeepSpeed computes the norm and skips such a step itself (it leaves
    the weights, the optimizer state and the schedule as they were, and counts it in
    `engine.skipped_steps`). With a plain torch optimizer (ZeRO-0, float32) the gradients are dropped
    before the step, and the optimizer and the schedule do not step (DeepSpeed's own bookkeeping of
    steps goes on as for its own skips)."""
    norm = None
    plain = engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled())
    skipped_before = engine.skipped_steps
    skipped = False
    if boundary and plain:
        grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
        if not math.isfinite(norm):
            for p in engine.module.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            skipped = True
    if skipped:
        with _no_update(engine):
            engine.step()
    else:
        engine.step()
    if boundary and norm is None:
        norm = engine.get_global_grad_norm()
    skipped = skipped or (boundary and engine.skipped_steps > skipped_before)
    if skipped and plain:
        engine.skipped_steps += 1
    return (None if norm is None else float(norm)), skipped


def explained_variance(samples: list[Sample]) -> float:
    """1 - Var(returns - values) / Var(returns) over generated tokens, with the values before the update."""
    returns = torch.cat([s.extra["returns"][s.loss_mask > 0] for s in samples])
    values = torch.cat([s.extra["old_values"][s.loss_mask > 0] for s in samples])
    var = returns.var(unbiased=False)
    if returns.numel() < 2 or var < 1e-12:
        return 0.0
    return float(1.0 - (returns - values).var(unbiased=False) / var)


def batch_indicators(scores: torch.Tensor, group_ids: torch.Tensor, samples: list[Sample], episodes) -> dict[str, float]:
    """Collapse indicators of one iteration: in-group reward std over all groups (before filtering),
    entropy over the trained tokens, response length, echoed reasoning across level seeds."""
    entropies = torch.cat([s.extra["entropies"] for s in samples])[None] if samples else torch.zeros(1, 0)
    mask = torch.cat([s.sampled_mask for s in samples])[None] if samples else torch.zeros(1, 0)
    lengths = torch.tensor([float(sum(t.response_length for t in ep.turns)) for ep in episodes])
    thoughts = [" ".join(t.info.get("parsed", {}).get("think", "") for t in ep.turns) for ep in episodes]
    values = core.collapse_indicators(scores, group_ids, entropies, mask, lengths, thoughts,
                                      [ep.seed for ep in episodes])
    return {
        "rollout/in_group_reward_std": values["reward_std_in_group"],
        "actor/entropy_mean": values["entropy_mean"],
        "rollout/trajectory_response_length": values["response_length_mean"],
        "rollout/echo_rate": values["echo_rate"],
        "rollout/distinct_2": values["distinct_2"],
    }
