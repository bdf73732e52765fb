"""Property test: arbitrary responses never raise, and a response that does not parse changes
nothing (state, text render and image render are identical before and after)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs_visual
from envs_visual import bandit
from envs_visual.base import PROMPT_FORMATS, format_response, parse_response

FIELD_NAMES = ("think", "observation", "reasoning", "prediction")

TAGS = ("think", "answer", "observation", "reasoning", "prediction")
WORDS = {
    "sokoban": ["Up", "Down", "Left", "Right", "up", "LEFT", "Jump"],
    "frozenlake": ["Up", "Down", "Left", "Right", "dOwN", "Stay"],
    # the arms of the seeds the fuzz resets to (0..3), and one that is never an arm
    "bandit": sorted({arm for seed in range(4) for arm in bandit.generate_level(seed)["arms"]}) + ["Unicorn"],
    "countdown": ["1", "7", "25", "(", ")", "+", "-", "*", "/", "×", "=", "3 + 4", "(2 * 5) - 1", "1/0"],
}  # fmt: skip


def words_for(name):
    return sorted({w for words in WORDS.values() for w in words}) if name == "all" else WORDS[name]


PARAMS = {"sokoban": {"cell_size": 14}, "frozenlake": {"cell_size": 14, "is_slippery": True}}
_ENVS = {}


def env_for(name, prompt_format):
    key = (name, prompt_format)
    if key not in _ENVS:
        _ENVS[key] = envs_visual.make(name, prompt_format=prompt_format, **PARAMS.get(name, {}))
    return _ENVS[key]


NOISE = [",", ", ", " ", "\n", "<", ">", "</", "<answer", "answer>", "<think >", "\x00", "é", "💥", "=", "0"]


def pieces(name):
    """Text strategies are cheap in hypothesis, lists of alternatives are not: draw a string over
    a small alphabet and map each character to a piece (a tag, an action word or noise)."""
    vocabulary = [f"<{t}>" for t in TAGS] + [f"</{t}>" for t in TAGS] + words_for(name) + NOISE
    alphabet = "".join(chr(0x4E00 + i) for i in range(len(vocabulary)))
    lookup = dict(zip(alphabet, vocabulary))
    return lambda max_size: st.text(alphabet=alphabet, max_size=max_size).map(
        lambda s: "".join(lookup[c] for c in s)
    )


def well_formed(name, prompt_format):
    """Responses in the right shape, with arbitrary field text and answers built from action
    words and separators, so that a good share parse (and some of those are valid)."""
    words = words_for(name)
    word_alphabet = "".join(chr(0x4E00 + i) for i in range(len(words)))
    lookup = dict(zip(word_alphabet, words))
    joined = st.tuples(
        st.text(alphabet=word_alphabet, max_size=4), st.sampled_from([",", ", ", " , ", " ", ""])
    ).map(lambda p: p[1].join(lookup[c] for c in p[0]))
    answer = st.one_of(st.sampled_from(words), joined)
    fields = st.text(max_size=12)

    def build(parts):
        field, answer, edge = parts
        response = format_response(prompt_format, answer, dict.fromkeys(FIELD_NAMES, field))
        return (prompt_format, edge[:1] + response + edge[1:])

    return st.tuples(fields, answer, st.sampled_from(["", "  ", "\n\n", " x", "x "])).map(build)


def responses():
    """(prompt_format, seed, response): arbitrary text, tag soup over every env's words, or a
    well-formed response for one env's words in one format."""
    formats = sorted(PROMPT_FORMATS)
    arbitrary = st.tuples(st.sampled_from(formats), st.one_of(st.text(), pieces("all")(14)))
    shaped = st.one_of([well_formed(name, f) for name in WORDS for f in formats])
    return st.tuples(st.integers(0, 3), st.one_of(arbitrary, shaped)).map(lambda c: (c[1][0], c[0], c[1][1]))


def snapshot(env):
    image = env.render_image().tobytes() if env.render_mode == "vision" else b""
    return env.state(), env.render_text(), image


def check(name, case):
    prompt_format, seed, response = case
    env = env_for(name, prompt_format)
    env.reset(seed=seed)
    before = snapshot(env)
    obs, reward, terminated, truncated, info = env.step(response)
    assert isinstance(reward, float) and math.isfinite(reward)
    assert obs.text.count("<image>") == len(obs.images)
    for key in ("success", "format_ok", "action_is_valid", "action_is_effective", "actions"):
        assert key in info
    if not parse_response(response, prompt_format).ok:
        assert snapshot(env) == before, response
        assert info["actions"] == [] and not info["format_ok"] and reward == 0.0
        assert not terminated and not truncated
    if info["format_ok"]:
        assert reward >= env.format_reward - 0.1 * env.max_actions_per_turn - 1.0
    else:
        assert len(info["actions"]) < env.max_actions_per_turn or not info["action_is_valid"]
    return info


ENVS = tuple(WORDS)


@settings(max_examples=2000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses())
def test_fuzz_every_env(case):
    """Each example goes to every env, so each env sees all 2,000 strings."""
    for name in ENVS:
        check(name, case)


def test_generated_responses_often_parse_and_are_valid():
    """Guards the strategies: for every env the fuzz must reach the action path too."""
    infos = {name: [] for name in ENVS}

    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(responses())
    def run(case):
        for name in ENVS:
            infos[name].append(check(name, case))

    run()
    for name, results in infos.items():
        valid = sum(info["format_ok"] for info in results)
        rejected = sum(not info["parsed"]["answer"] for info in results)
        assert valid >= 5 and rejected >= 50, (name, valid, rejected)


def test_robustness_benchmark_counts_what_it_promises():
    """benchmarks/robustness.py: its near-misses mostly fail to parse, none raises or acts, and its
    scripted soak finishes episodes."""
    from benchmark_scripts import load

    robustness = load("robustness")
    result = robustness.fuzz("sokoban", 300, seed=1)
    assert result["errors"] == [] and result["acted"] == 0
    assert 150 <= result["malformed"] < 300  # near-misses and noise, and some well-formed answers
    soak = robustness.soak("frozenlake", 20)
    assert soak["episodes"] == 20 and soak["success"] == 1.0  # the solver solves every level
    assert 0 < soak["rss_warm"] and soak["steps"] >= 20
