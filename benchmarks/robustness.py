"""Bad input at scale and long runs, per environment: prints two tables.

    python benchmarks/robustness.py [--fuzz 10000] [--soak 2000] [--envs sokoban frozenlake ...]

- fuzz: `--fuzz` responses per environment, drawn from a seeded mix of near-misses of the format
  (a well-formed response with a tag dropped, doubled, nested, misspelt, reordered or cut; an action
  misspelt; separators and whitespace changed), random text, long strings (up to 20,000 characters),
  non-ASCII and control characters. Every response goes to `env.step` of a freshly reset level in a
  prompt format drawn per response. Counted: exceptions, and actions taken from a response that
  does not parse (`info["actions"]` not empty, or the state or the frame changed). Both must be 0.
- soak: `--soak` episodes per environment played by a scripted policy (the env's `solve()` where it
  has one; Countdown: the sum of its numbers; else the first action every turn), with the resident memory of the process read after
  a warm-up of a tenth of the episodes and at the end; growth must stay under 5%. An episode stops
  after 20 turns, as a rollout's `max_turns` would stop it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import envs_visual  # noqa: E402
from envs_visual.base import PROMPT_FORMATS, format_response, parse_response  # noqa: E402

ENVS = ("sokoban", "frozenlake", "bandit", "countdown", "navigation", "manipulation")
PARAMS = {"sokoban": {"cell_size": 28}, "frozenlake": {"cell_size": 28, "is_slippery": False}}
TAGS = ("think", "answer", "observation", "reasoning", "prediction")
NOISE = ["", " ", "\n", "\t", ",", ", ", ";", "<", ">", "</", "<<answer>>", "<answer", "answer>", "<ANSWER>",
         "< answer>", "\x00", "\x1b[31m", "\u200b", "é", "💥", "漢字", "Ω", "\ufeff", "<think/>", "</think>",
         "<answer></answer>", "eval(1)", "__import__('os')", "{}", "[]", "None", "-1", "1e309", "NaN"]


def actions_of(env) -> list[str]:
    names = list(getattr(env, "action_names", None) or [])
    if not names and hasattr(env, "solve"):  # actions with arguments (manipulation): the solver's own
        names = env.solve()
    return names or ["Up", "Down", "Left", "Right"]


def well_formed(rng: random.Random, env, prompt_format: str) -> str:
    names = actions_of(env)
    answer = rng.choice([",", ", ", " "]).join(rng.choice(names) for _ in range(rng.randint(1, 4)))
    fields = {name: rng.choice(["", "the box is left of me", "I go up", "x" * rng.randint(0, 50)])
              for name in ("think", "observation", "reasoning", "prediction")}
    return format_response(prompt_format, answer, fields)


def mutate(rng: random.Random, text: str, env) -> str:
    """One near-miss of a well-formed response."""
    kind = rng.randrange(10)
    tags = [f"<{t}>" for t in TAGS] + [f"</{t}>" for t in TAGS]
    present = [t for t in tags if t in text]
    if kind == 0 and present:  # a tag dropped
        return text.replace(rng.choice(present), "", 1)
    if kind == 1 and present:  # a tag doubled
        tag = rng.choice(present)
        return text.replace(tag, tag + tag, 1)
    if kind == 2:  # nested tags
        return text.replace("<answer>", "<answer><answer>" + rng.choice(TAGS), 1) + "</answer>"
    if kind == 3 and present:  # a misspelt tag
        tag = rng.choice(present)
        return text.replace(tag, tag.replace(">", rng.choice(["s>", " >", ">>", "/>"]), 1), 1)
    if kind == 4:  # cut anywhere
        return text[: rng.randrange(len(text) + 1)]
    if kind == 5:  # text outside the tags
        return rng.choice(["Sure! ", "```", "answer: "]) + text + rng.choice(["", " thanks", "\n\nmore"])
    if kind == 6:  # a misspelt or foreign action
        word = rng.choice(actions_of(env))
        return text.replace(word, rng.choice([word.lower() + "x", word[::-1], "Jump", "", "Up Up"]), 1)
    if kind == 7:  # noise spliced in
        at = rng.randrange(len(text) + 1)
        return text[:at] + rng.choice(NOISE) + text[at:]
    if kind == 8:  # the answer block first
        return text.split("<answer>")[-1] + text
    return text.replace("</answer>", "</answer>" + text, 1)  # two answers


def random_text(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(0, 80)))
    if kind == 1:  # a long string
        return rng.choice(["<answer>Up</answer>", "a", "<think>", "漢"]) * rng.randint(100, 5000)
    if kind == 2:
        return "".join(rng.choice(NOISE + [f"<{t}>" for t in TAGS] + [f"</{t}>" for t in TAGS])
                       for _ in range(rng.randint(0, 30)))
    return "".join(chr(rng.randrange(0, 0x110000)) for _ in range(rng.randint(0, 20))).encode(
        "utf-8", "replace").decode("utf-8", "replace")


def snapshot(env):
    image = env.render_image().tobytes() if env.render_mode == "vision" else b""
    return repr(env.state()), env.render_text(), image


def fuzz(name: str, n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    formats = sorted(PROMPT_FORMATS)
    envs = {f: envs_visual.make(name, prompt_format=f, **PARAMS.get(name, {})) for f in formats}
    errors, acted, malformed, t0 = [], 0, 0, time.perf_counter()
    for i in range(n):
        prompt_format = rng.choice(formats)
        env = envs[prompt_format]
        try:
            env.reset(seed=rng.randrange(64))
            draw = rng.random()
            response = (random_text(rng) if draw < 0.3 else
                        mutate(rng, well_formed(rng, env, prompt_format), env) if draw < 0.9 else
                        well_formed(rng, env, prompt_format))
            if not parse_response(response, prompt_format).ok:
                malformed += 1
                before = snapshot(env)
                _, _, _, _, info = env.step(response)
                if info["actions"] or snapshot(env) != before:
                    acted += 1
            else:
                env.step(response)
        except Exception:  # the count is the point: nothing may raise
            errors.append(f"{name} #{i}: {traceback.format_exc(limit=2).splitlines()[-1]}")
    for env in envs.values():
        getattr(env, "close", lambda: None)()
    return {"n": n, "malformed": malformed, "errors": errors, "acted": acted, "seconds": time.perf_counter() - t0}


MAX_TURNS = 20  # as a rollout's max_turns would: an env may let an invalid answer go on for ever


def scripted_answer(env) -> str:
    """The env's own solution for this turn where it has one; Countdown: every number added up."""
    if hasattr(env, "solve"):
        plan = env.solve() or [actions_of(env)[0]]
        return ", ".join(plan[: env.max_actions_per_turn])
    state = env.state()
    if "numbers" in state:
        return " + ".join(str(n) for n in state["numbers"])
    return actions_of(env)[0]


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not in /proc/self/status")


def soak(name: str, episodes: int) -> dict:
    env = envs_visual.make(name, prompt_format="free_think", **PARAMS.get(name, {}))
    warm = max(1, episodes // 10)
    t0, successes, steps = time.perf_counter(), 0, 0
    after_warmup = None
    for episode in range(episodes):
        if episode == warm:
            after_warmup = rss_bytes()
        env.reset(seed=episode)
        done, turns = False, 0
        while not done and turns < MAX_TURNS:
            _, _, terminated, truncated, info = env.step(format_response("free_think", scripted_answer(env)))
            steps += 1
            turns += 1
            done = terminated or truncated
        successes += bool(info.get("success"))
    end = rss_bytes()
    getattr(env, "close", lambda: None)()
    base = after_warmup or end
    return {"episodes": episodes, "steps": steps, "success": successes / episodes, "rss_warm": base, "rss_end": end,
            "growth": (end - base) / base, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzzed responses per environment (0: skip)")
    parser.add_argument("--soak", type=int, default=2_000, help="scripted episodes per environment (0: skip)")
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=ENVS)
    args = parser.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "egl")
    failed = False
    if args.fuzz:
        print("| env | responses | malformed | exceptions | actions from malformed | seconds |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in args.envs:
            r = fuzz(name, args.fuzz)
            print(f"| {name} | {r['n']:,} | {r['malformed']:,} | {len(r['errors'])} | {r['acted']} | {r['seconds']:.0f} |",
                  flush=True)
            for line in r["errors"][:5]:
                print(f"  {line}")
            failed |= bool(r["errors"]) or r["acted"] > 0
    if args.soak:
        print("\n| env | episodes | turns | scripted success | RSS after warm-up (MB) | RSS at end (MB) | growth | seconds |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in args.envs:
            r = soak(name, args.soak)
            print(f"| {name} | {r['episodes']:,} | {r['steps']:,} | {r['success']:.3f} | {r['rss_warm'] / 2**20:.0f} | "
                  f"{r['rss_end'] / 2**20:.0f} | {100 * r['growth']:+.1f}% | {r['seconds']:.0f} |", flush=True)
            failed |= r["growth"] >= 0.05
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
