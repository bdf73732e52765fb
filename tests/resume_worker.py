"""Run by tests/test_resume.py as its own process (under a launcher when there are several ranks):
`vagen.train.main` with the arguments given. `--dump DIR` writes the actor's trainable parameters as
DeepSpeed holds them, fp32 master weights and AdamW moments gathered whole from the ranks
(`deepspeed.utils.safe_get_full_*`, collective), from rank 0: `DIR/saved_step_N.pt` just before
checkpoint step_N is written, and `DIR/resumed_step_N.pt` right after step_N's states are loaded; the critic's
(where the run has one) as `DIR/saved_critic_step_N.pt` and `DIR/resumed_critic_step_N.pt`. `--reward-bonus R`:
every step's reward is R more (so that returns, and the critic's gradient, are not 0 where the policy scores
nothing)."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import vagen.run  # noqa: E402
from vagen.train import main  # noqa: E402


def full_states(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {name: {"fp32": safe_get_full_fp32_param(p).clone(),
                   "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                   "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
            for name, p in engine.module.named_parameters() if p.requires_grad}


def dump(out: str, engine) -> None:
    states = full_states(engine)  # every rank takes part
    if torch.distributed.get_rank() == 0:
        torch.save(states, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", required=True)
    parser.add_argument("--reward-bonus", type=float, default=0.0)
    args, rest = parser.parse_known_args()
    if args.reward_bonus:
        import vagen.rollout

        real_make_env = vagen.rollout.make_env

        class Bonus:
            def __init__(self, env):
                self.env = env

            def __getattr__(self, name):
                return getattr(self.env, name)

            def step(self, text):
                obs, reward, terminated, truncated, info = self.env.step(text)
                return obs, reward + args.reward_bonus, terminated, truncated, info

        vagen.rollout.make_env = lambda *a, **k: Bonus(real_make_env(*a, **k))
    real_save, real_resume = vagen.run.save_checkpoint, vagen.run.RunDir.maybe_resume

    def save_checkpoint(out, it, actor_engine, critic_engine, *a, **k):
        dump(os.path.join(args.dump, f"saved_{out.name}.pt"), actor_engine)
        if critic_engine is not None:
            dump(os.path.join(args.dump, f"saved_critic_{out.name}.pt"), critic_engine)
        return real_save(out, it, actor_engine, critic_engine, *a, **k)

    def maybe_resume(self, cfg, actor_engine, critic_engine, *a, **k):
        start = real_resume(self, cfg, actor_engine, critic_engine, *a, **k)
        if self.resume_from is not None:
            dump(os.path.join(args.dump, f"resumed_{self.resume_from.name}.pt"), actor_engine)
            if critic_engine is not None:
                dump(os.path.join(args.dump, f"resumed_critic_{self.resume_from.name}.pt"), critic_engine)
        return start

    vagen.run.save_checkpoint, vagen.run.RunDir.maybe_resume = save_checkpoint, maybe_resume
    sys.exit(main(rest))
