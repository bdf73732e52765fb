"""Multi-turn rollouts: groups of environments share a level seed; each turn the active episodes go to
a decoder (`vagen.decoding`) in one batch, and every episode keeps the exact token ids the policy saw
and produced, so that training sees the same sequence as sampling did (`vagen.episode` has the layout).
"""

from __future__ import annotations

import time

from vagen.decoding import Decoder, Sampling, sampling_from, turn_seed
from vagen.decoding_hf import HFDecoder
from vagen.env_workers import (  # noqa: F401 (EnvTimeout, time_limit, env_error_summary: part of this module's API)
    EnvFactory,
    EnvTimeout,
    EnvWorkers,
    InProcessEnvs,
    build_env,
    env_error_summary,
    time_limit,
)
from vagen.episode import ChatEncoder, Episode, Segment, Turn, TurnContext, train_seeds
from vagen.staleness import Admission


def make_env(cfg_env, seed_env_params: dict | None = None):
    return build_env(cfg_env, seed_env_params)


def make_envs(cfg_env, count: int, owner: str | None = None):
    """A run's `count` environments: built here (`env.workers=0`), or held by `env.workers` processes
    (`EnvWorkers`), Ray actors (`env.backend=ray`, `vagen.env_ray.RayEnvWorkers`, whose namespace `owner`,
    a run and rank, names) or sessions on environment servers (`env.backend=http`, `vagen.env_http`), which
    live until `close_envs`."""
    if cfg_env.backend == "http":
        from vagen.env_http import HttpEnvWorkers  # httpx is an optional dependency

        return HttpEnvWorkers.from_config(cfg_env, count)
    if cfg_env.workers > 0 and cfg_env.backend == "ray":
        from vagen.env_ray import RayEnvWorkers  # Ray is an optional dependency

        return RayEnvWorkers.from_config(cfg_env, EnvFactory(cfg_env), count, owner)
    if cfg_env.workers > 0:
        return EnvWorkers(EnvFactory(cfg_env), count, cfg_env.workers, cfg_env.step_timeout)
    return [make_env(cfg_env) for _ in range(count)]


def close_envs(envs) -> None:
    for env in envs if isinstance(envs, list) else [envs]:
        if hasattr(env, "close"):
            env.close()


def make_decoder(cfg, model, encoder: ChatEncoder) -> Decoder:
    """The engine `rollout.backend` names, decoding `model`'s policy."""
    if cfg.rollout.backend == "hf":
        # A window drops its oldest turn as it slides, so a cache kept across turns would no longer hold a
        # prefix of the next prompt: with rollout.context=window each turn runs its whole window.
        keep_cache = cfg.rollout.reuse_cache and cfg.rollout.context == "full"
        return HFDecoder(model, encoder, keep_cache=keep_cache)
    if cfg.rollout.backend == "vllm":
        from vagen.decoding_vllm import VLLMDecoder  # vLLM is an optional dependency

        return VLLMDecoder.from_config(cfg, model, encoder)
    raise ValueError(f"unknown rollout.backend {cfg.rollout.backend!r}; choices: hf, vllm")


def rollout(model, encoder: ChatEncoder, cfg, seeds: list[int], group_size: int, *, do_sample: bool | None = None,
            envs=None, on_step=None, progress=None, decoder: Decoder | None = None,
            sample_seed: int = 0, schedule: str | None = None) -> tuple[list[Episode], dict[str, float]]:
    """Play `len(seeds) * group_size` episodes (members of a group share a seed) for up to
    `cfg.rollout.max_turns` turns, decoding with `decoder` (default: `rollout.backend` over `model`).
    `envs`: a list of environments, or `EnvWorkers` (`make_envs`); default: made for this call as
    `env.workers` says. `schedule`: how the decoder plays, `turns` (`play_in_turns`) or `loop` (its agent
    loop, `decoder.play`); default: the loop where the decoder has one.
    Returns the episodes and timing/length metrics. `progress` (a `vagen.console.progress_bar`) is
    advanced by one as each episode ends; `sample_seed` seeds engines that seed each request."""
    if schedule not in (None, "turns", "loop"):
        raise ValueError(f"rollout(schedule={schedule!r}); choices: turns, loop, None (the decoder's own)")
    decoder = decoder if decoder is not None else make_decoder(cfg, model, encoder)
    if schedule == "loop" and not hasattr(decoder, "play"):
        raise ValueError(f"{type(decoder).__name__} has no agent loop (play); use schedule='turns'")
    n = len(seeds) * group_size
    owned = envs is None
    envs = make_envs(cfg.env, n) if owned else envs
    try:  # environments made here are closed whatever fails, their worker processes included
        pool = InProcessEnvs(envs, cfg.env.step_timeout) if isinstance(envs, list) else envs
        assert len(pool) == n, f"{len(pool)=} {n=}"
        if on_step is not None and not isinstance(pool, InProcessEnvs):
            raise ValueError("rollout(on_step=...) is called with the environment object, which lives in a worker "
                             "process with env.workers > 0; use env.workers=0, or read the step's info from the "
                             "episodes")
        game = Game(encoder, cfg, seeds, group_size, pool, do_sample, sample_seed, on_step, progress)
        play_game(decoder, game, schedule)
    finally:
        if owned:
            close_envs(envs)
    for ep in game.episodes:
        ep.done = True
    game.ended.count()
    return game.episodes, game.timing


def play_game(decoder: Decoder, game: Game, schedule: str | None = None) -> None:
    decoder.start_rollout()
    if schedule == "turns" or not hasattr(decoder, "play"):
        play_in_turns(decoder, game)
    else:
        decoder.play(game)


class Rollouts:
    """A training run's rollouts on one rank, one batch per update. Groups are admitted in order
    (`vagen.staleness.Admission`), each playing the level and request seeds its number gives; with
    `rollout.max_staleness` = k > 0 a rollout ends once this rank's share of groups has ended whole, and the
    episodes still unfinished wait between turns in the `Game`, which lives from one rollout to the next,
    for the next weights. `envs` (a list, or `EnvWorkers`) holds (k + 1) x the share's episodes."""

    def __init__(self, encoder: ChatEncoder, cfg, envs, rank: int = 0, world_size: int = 1, start: int = 0,
                 admission: Admission | None = None):
        self.cfg, self.rank, self.envs = cfg, rank, envs
        # `admission`: restored from a checkpoint (`Admission.state_dict`) when the run resumes
        self.admission = admission or Admission.for_config(cfg, world_size)
        self.admission.resume(start)
        pool = InProcessEnvs(envs, cfg.env.step_timeout) if isinstance(envs, list) else envs
        needed = self.admission.in_flight_limit * cfg.rollout.group_size
        assert len(pool) == needed, f"{len(pool)=} {needed=}"
        self.game = Game(encoder, cfg, [], cfg.rollout.group_size, pool, None, 0, admission=self.admission)

    def graded(self) -> tuple[str, ...]:
        """The graded fields of this run's prompt format (`graded_scores`), for `rollout_metrics`."""
        return graded_scores(example_env(self.envs))

    def play(self, decoder: Decoder, version: int, saves_in: int = 0) -> tuple[list[Episode], dict[str, float]]:
        """The rollout before the update of `version`: the episodes of the B groups due (this rank's share, the first
        admitted: `Admission.due`), which it plays to their end, in admission order (`group_id` their rank among
        them), and the rollout's metrics. Carried episodes go on first, new groups are admitted up to the bound;
        groups that ended but are not due wait for their update. `saves_in`: the rollouts until a checkpoint, this
        one counted (0: none scheduled within k + 1): fewer groups are admitted before it (`Admission.limit`), and
        at 1 every group admitted ends, so that the checkpoint holds none."""
        play_game(decoder, self.begin(version, saves_in))
        return self.end()

    def begin(self, version: int, saves_in: int = 0) -> Game:
        """The first half of `play`: the carried episodes go on and new groups are admitted (their environments
        reset); returns the game for a decoder to play (`vagen.tasks` plays every task's in one agent loop)."""
        cfg, game, share = self.cfg, self.game, self.admission.groups_per_rank
        game.start(version, drain=saves_in == 1)
        for number in self.admission.admit(version, saves_in):
            iteration, index = self.admission.level(number)
            seed = train_seeds(iteration, cfg.rollout.env_groups, cfg.train.seed)[self.rank * share + index]
            sample_seed = (cfg.train.seed * 1_000_003 + iteration) * 1_009 + self.rank
            game.admit(number, seed, sample_seed, index * cfg.rollout.group_size)
            game.sample_seed = sample_seed  # the per-turn schedule's, which plays k = 0 only (one iteration's groups)
        game.take_answers(block=True, all_of_them=True)
        return game

    def end(self) -> tuple[list[Episode], dict[str, float]]:
        """The second half of `play`, once the game is played: the episodes of the groups that ended whole and
        the rollout's metrics."""
        cfg, game = self.cfg, self.game
        episodes = game.collect()
        self.admission.end(len(episodes) // cfg.rollout.group_size)
        stats = dict(game.timing)
        stats["rollout/carried_episodes"] = float(len(game.waiting))
        return episodes, stats


def play_in_turns(decoder: Decoder, game: Game) -> None:
    """The per-turn schedule: every running episode's turn t goes to `decoder.generate` as one batch, and
    turn t + 1 starts once every environment has answered turn t (stepped in parallel with workers)."""
    for turn in range(game.max_turns):
        game.take_answers(block=True, all_of_them=True)
        game.ended.count()
        active = [i for i in game.ready]
        game.ready.clear()
        # Under ZeRO-3 over several ranks, a rank whose episodes have ended keeps generating (idle) while
        # another rank's go on: forward passes are collective there.
        if not decoder.any_rank(bool(active)):
            break
        t0 = time.perf_counter()
        generated = decoder.generate([game.episodes[i] for i in active], active, game.sampling(turn))
        game.timing["timing/generate"] += time.perf_counter() - t0
        for i, new in zip(active, generated):
            game.respond(i, new)
    game.take_answers(block=True, all_of_them=True)  # the last turn's


class Game:
    """The episodes of one rollout as a decoder plays them, whatever the schedule. A decoder takes
    `ready` (episodes whose next prompt is in their `input_ids`, ascending), answers each with `respond`
    (which sends the response to its environment), and collects the environments' answers with
    `take_answers`, which opens the next turns. `timing` collects the rollout's metrics: `timing/env` is the
    time spent stepping environments here or waiting for a worker's answer, the decoder's wait for them.

    Episodes sit in slots, one per environment of `pool`, a group in `group_size` consecutive slots. A
    training run's `Rollouts` keeps one game over its rollouts: with an `admission`, the rollout closes once
    the groups due at the update (`Admission.due`) have ended whole, and from then on the next turns of the
    other groups go to `waiting` instead of `ready`; `start` sends them on."""

    def __init__(self, encoder: ChatEncoder, cfg, seeds: list[int], group_size: int, pool, do_sample, sample_seed: int,
                 on_step=None, progress=None, admission: Admission | None = None):
        self.encoder, self.ro, self.env_cfg, self.pool = encoder, cfg.rollout, cfg.env, pool
        self.max_turns, self.do_sample, self.sample_seed, self.on_step = cfg.rollout.max_turns, do_sample, sample_seed, on_step
        self.timing = {"timing/generate": 0.0, "timing/env": 0.0, "rollout/generated_tokens": 0.0}
        n = len(pool)
        self.episodes: list[Episode | None] = [None] * n
        self.observations: list = [None] * n
        self.responses: dict[int, tuple] = {}  # episode -> its turn's response, waiting for the environment
        self.ready: list[int] = []
        self.waiting: list[int] = []  # episodes whose next turn waits for the next rollout (rollout.max_staleness)
        self.seeds: list[int | None] = [None] * n
        self.requests: list[tuple[int, int]] = [(sample_seed, i) for i in range(n)]  # (sample seed, row) of each slot
        self.groups: dict[int, list[int]] = {}  # admission number -> the slots of its episodes
        self.group_size = group_size
        self.admission, self.version, self.draining, self.closed = admission, 0, False, False
        pool.check_idle()  # a worker that died since the pool's last rollout is replaced before any request
        for number, seed in enumerate(seeds):
            self.admit(number, seed, sample_seed, number * group_size)
        self.take_answers(block=True, all_of_them=True)
        self.ended = Ended(self.episodes, progress)

    def admit(self, number: int, seed: int, sample_seed: int, row: int) -> None:
        """Start group `number` on level `seed` in the first free slots; its episodes' requests are seeded by
        `sample_seed` and rows `row`, `row + 1`, ... (`request`)."""
        used = {slot for slots in self.groups.values() for slot in slots}
        free = [slot for slot in range(len(self.episodes)) if slot not in used][: self.group_size]
        assert len(free) == self.group_size, f"no {self.group_size} free slots of {len(self.episodes)} for group {number}"
        self.groups[number] = free
        for k, slot in enumerate(free):
            self.seeds[slot], self.requests[slot], self.episodes[slot] = seed, (sample_seed, row + k), None
            self.pool.reset(slot, seed)

    def start(self, version: int, drain: bool = False) -> None:
        """A new rollout, before the update of `version`: the waiting episodes go on (with the new weights)."""
        self.version, self.draining, self.closed = version, drain, False
        self.timing = dict.fromkeys(self.timing, 0.0)
        # A worker that died during the update (killed for memory, say) is replaced now, its environments
        # rebuilt by replay, so that the waiting episodes stepping there go on.
        self.pool.check_idle()
        self.ready = sorted(self.ready + self.waiting)
        self.waiting = []

    def collect(self) -> list[Episode]:
        """The episodes of the groups due (`Admission.due`, default: every group), which have ended whole, in
        admission order, `group_id` their group's rank among them; their slots are freed. Other groups stay, those
        that ended included, for a later update."""
        episodes = []
        for number in self.due():
            assert self.group_ended(number), f"group {number} is due but has not ended ({sorted(self.groups)=})"
            for slot in self.groups.pop(number):
                episode = self.episodes[slot]
                episode.group_id, episode.admission = len(episodes) // self.group_size, number
                episodes.append(episode)
                self.episodes[slot] = None
        return episodes

    def due(self) -> list[int]:
        """The groups the next update trains: with an admission its B first admitted (`Admission.due`)."""
        return self.admission.due(self.groups) if self.admission is not None else sorted(self.groups)

    def group_ended(self, number: int) -> bool:
        return all(self.episodes[slot] is not None and self.episodes[slot].done and slot not in self.responses
                   for slot in self.groups[number])

    def holds(self, i: int) -> bool:
        """Whether episode `i`'s next turn waits for the next rollout: the rollout has closed (its due groups have
        ended, so `i`'s group is not due) and does not drain."""
        return self.closed and not self.draining

    def sampling(self, turn: int) -> Sampling:
        """How turn `turn` of every episode is decoded: its seed from the rollout's and the turn."""
        return sampling_from(self.ro, self.do_sample, seed=turn_seed(self.sample_seed, turn))

    def request(self, i: int) -> tuple[Sampling, int]:
        """How episode `i`'s next turn is decoded, and the row its request is seeded by (`request_seed`): the seed
        of its group's rollout and its turn, as in the per-turn schedule."""
        sample_seed, row = self.requests[i]
        turn = len(self.episodes[i].turns)
        return sampling_from(self.ro, self.do_sample, seed=turn_seed(sample_seed, turn)), row

    def finished(self) -> bool:
        """No episode generates again: none is ready, and no environment has an answer still to give."""
        return not self.ready and not self.responses

    def take_answers(self, block: bool = False, all_of_them: bool = False, until: float | None = None) -> int:
        """Apply the environments' answers that arrived (with `block`, wait for at least one while any is
        due; with `all_of_them`, for every one due, or until `time.perf_counter()` reaches `until`) and open
        each answered episode's next turn. Returns how many answers it applied."""
        taken = 0
        while True:
            t0 = time.perf_counter()
            timeout = None if until is None else max(0.0, until - t0)
            answers = self.pool.answers(block=block and self.pool.busy(), timeout=timeout)
            self.timing["timing/env"] += time.perf_counter() - t0
            taken += len(answers)
            for answer in sorted(answers, key=lambda a: a.index):
                if answer.kind == "reset":
                    self.reset_answered(answer)
                else:
                    self.step_answered(answer)
            if not (all_of_them and self.pool.busy()) or (until is not None and time.perf_counter() >= until):
                break
        if self.admission is not None and not self.closed:
            self.closed = all(self.group_ended(number) for number in self.due())
            if self.closed:
                held = [i for i in self.ready if self.holds(i)]
                self.ready = [i for i in self.ready if i not in held]
                self.waiting += held
        self.ready.sort()
        return taken

    def reset_answered(self, answer) -> None:
        """A new episode, reset to its group's level seed; an environment that raised ends its own episode
        there (failed), not the rollout."""
        i, seed = answer.index, self.seeds[answer.index]
        group_id = i // self.group_size  # in admission order while no group has been collected
        if answer.error is None:
            obs, info, system_prompt = answer.value
            self.episodes[i] = Episode(self.env_cfg.name, seed, group_id, system_prompt,
                                       initial_observation=obs, initial_state_key=info.get("state_key"))
            self.observations[i] = obs
            self.open(i)
        else:
            self.episodes[i] = Episode(self.env_cfg.name, seed, group_id, "", done=True,
                                       error=f"reset: {answer.error}")

    def open(self, i: int) -> None:
        """Episode `i`'s next turn, ready (or waiting, `holds`); an episode that has no next turn has ended."""
        ep = self.episodes[i]
        if not ep.done and len(ep.turns) < self.max_turns and open_episode(self.encoder, ep, self.observations[i], self.ro):
            (self.waiting if self.holds(i) else self.ready).append(i)
        else:
            ep.done = True

    def respond(self, i: int, new) -> None:
        """Close episode `i`'s turn with <|im_end|> and send its text to the environment."""
        ep = self.episodes[i]
        ids, text = self.encoder.finish_response(new.ids)
        start = len(ep.input_ids)
        ep.input_ids += ids
        self.responses[i] = (new, ids, text, start, self.version)
        self.timing["rollout/generated_tokens"] += len(ids)
        t0 = time.perf_counter()
        self.pool.step(i, text)  # in this process (env.workers=0) the step runs here
        self.timing["timing/env"] += time.perf_counter() - t0

    def step_answered(self, answer) -> None:
        """Record the turn the environment answered; an environment that raised ends the episode there,
        failed."""
        i = answer.index
        ep = self.episodes[i]
        new, ids, text, start, version = self.responses.pop(i)
        obs = self.observations[i]
        state_key = ep.turns[-1].info.get("state_key") if ep.turns else ep.initial_state_key
        if answer.error is None:
            next_obs, reward, terminated, truncated, info = answer.value
        else:
            ep.error = f"step {len(ep.turns)}: {answer.error}"
            next_obs, reward, terminated, truncated = None, 0.0, True, False
            info = {"success": False, "format_ok": False, "action_is_valid": False, "action_is_effective": False,
                    "actions": [], "env_error": ep.error}
        if self.on_step is not None and ep.error is None:
            self.on_step(i, self.pool.env(i), info)
        end_sampled = self.encoder.sampled_end(new.ids)
        logprobs = None if new.logprobs is None else list(new.logprobs[: len(ids) - (not end_sampled)])
        context = None
        if ep.segments:  # rollout.context=window: the turn's own sequence is its window and its response
            ep.segments[-1].response_ids = ids
            context = TurnContext(list(ep.input_ids), list(ep.pixel_values), list(ep.image_grid_thw))
        ep.turns.append(Turn(obs.text, obs.images, text, reward, info, (start, len(ep.input_ids)), len(ids),
                             end_sampled=end_sampled, sampled_logprobs=logprobs, state_key=state_key, context=context,
                             version=version))
        ep.success = bool(info.get("success", False))
        self.observations[i] = next_obs
        if terminated or truncated:
            ep.done = True
        self.open(i)


class Ended:
    """Advances a progress bar by the episodes that ended since the last count."""

    def __init__(self, episodes: list[Episode], progress):
        self.episodes, self.progress, self.ended = episodes, progress, 0

    def count(self) -> None:
        now = sum(ep is not None and ep.done for ep in self.episodes)
        if self.progress is not None and now > self.ended:
            self.progress.update(now - self.ended)
        self.ended = now


def open_episode(encoder: ChatEncoder, ep: Episode, obs, ro) -> bool:
    """Append the episode's observation (text and frames, resized once) to its history, or with
    `rollout.context=window` make its window the next prompt (`window_prompt`); returns whether it
    generates a turn. An episode whose next turn would not fit in `rollout.max_trajectory_length` ends
    before it: whole turns only, so an image is never cut and what was played stays trainable."""
    images = [encoder.resize(image) for image in obs.images] if encoder.is_vision else obs.images
    if ro.context == "window":
        _, pixel_values, grids = encoder.user_segment(obs.text, images, first=False, system=None)
        segment = Segment(obs.text, images, pixel_values, grids)
        prompt = window_prompt(encoder, ep.system_prompt, ep.segments + [segment], ro.window_turns)
        if len(prompt.input_ids) + ro.max_new_tokens + 1 > ro.max_trajectory_length:
            ep.done = True
            ep.truncated_by_length = True
            return False
        ep.segments.append(segment)
        ep.input_ids, ep.pixel_values, ep.image_grid_thw = prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw
        ep.images = [image for seg in ep.segments[-ro.window_turns - 1:] for image in seg.images]
        return True
    ids, pixel_values, grids = encoder.user_segment(obs.text, images, first=not ep.turns, system=ep.system_prompt)
    if len(ep.input_ids) + len(ids) + ro.max_new_tokens + 1 > ro.max_trajectory_length:
        ep.done = True
        ep.truncated_by_length = True
        return False
    ep.input_ids += ids
    ep.pixel_values += pixel_values
    ep.image_grid_thw += grids
    ep.images += images
    return True


def window_prompt(encoder: ChatEncoder, system: str, segments: list[Segment], window_turns: int) -> TurnContext:
    """The prompt of the turn that answers `segments[-1]` with `rollout.context=window`: the system prompt,
    the last `window_turns` earlier turns (each observation with its frames, then the response as sampled)
    and the new observation, as one chat. The oldest turn kept opens the chat, after the system prompt."""
    kept = segments[max(0, len(segments) - 1 - window_turns):]
    ids, pixel_values, grids = [], [], []
    for k, segment in enumerate(kept):
        ids += encoder.segment_ids(segment.text, segment.image_grid_thw, first=k == 0, system=system)
        if k < len(kept) - 1:
            ids += segment.response_ids
        pixel_values += segment.pixel_values
        grids += segment.image_grid_thw
    return TurnContext(ids, pixel_values, grids)


GRADED_SCORES = (("observation", "grounding_score"), ("prediction", "worldmodel_score"))


def example_env(envs):
    """One environment of `envs` (a list, or a worker pool's example) to read its prompt format and graded fields."""
    return envs[0] if isinstance(envs, list) else envs.example()


def graded_scores(env) -> tuple[str, ...]:
    """The info keys of the state scores `env` grades every turn in its prompt format: `grounding_score`
    where the format has an <observation>, `worldmodel_score` where it has a <prediction>, none for an
    env whose state is not graded."""
    from envs_visual.base import PROMPT_FORMATS

    fields = PROMPT_FORMATS[env.prompt_format] or ()
    return tuple(key for name, key in GRADED_SCORES if name in fields) if env.state_weights else ()


def rollout_metrics(episodes: list[Episode], graded: tuple[str, ...] | dict[str, tuple[str, ...]] = ()
                    ) -> dict[str, float]:
    """Means over episodes of success, return, turns, format and validity rates, response length, and the
    state scores of graded fields (after the state reward's repetition check, when it ran): for the
    `graded` keys (`graded_scores`; with rollout.tasks a dict of them by task name, each episode's its own
    task's) over every turn, a turn whose description did not parse counting 0, so the curve exists from the
    first iteration; for others over the turns that have them.

    Per turn (docs/environments.md, "Format ok and action valid"): `rollout/format_ok` is the share whose
    response parsed into the prompt format's fields, `rollout/action_valid` the share that also named at
    least one action and only legal ones (the turns the format reward pays), so action_valid <= format_ok."""
    def mean(values):
        values = list(values)
        return float(sum(values) / len(values)) if values else 0.0

    turns = [t for ep in episodes for t in ep.turns]
    scores = {key: [] for _, key in GRADED_SCORES}
    for ep in episodes:
        keys = graded.get(ep.task, ()) if isinstance(graded, dict) else graded
        for t in ep.turns:
            for _, key in GRADED_SCORES:
                if key in keys:
                    scores[key].append(t.info.get(key) or 0.0)
                elif t.info.get(key) is not None:
                    scores[key].append(t.info[key])
    return {
        "rollout/success": mean(ep.success for ep in episodes),
        "rollout/reward_mean": mean(ep.total_reward for ep in episodes),
        "rollout/turns": mean(len(ep.turns) for ep in episodes),
        "rollout/actions": mean(sum(len(t.info.get("actions", [])) for t in ep.turns) for ep in episodes),
        "rollout/format_ok": mean(bool(t.info.get("format_ok")) for t in turns),
        "rollout/action_valid": mean(bool(t.info.get("action_is_valid")) for t in turns),
        "rollout/action_effective": mean(bool(t.info.get("action_is_effective")) for t in turns),
        "rollout/response_length": mean(t.response_length for t in turns),
        "rollout/truncated_trajectories": float(sum(ep.truncated_by_length for ep in episodes)),
        "rollout/env_errors": float(sum(ep.error is not None for ep in episodes)),
        # how well the graded fields match the true state, whether or not they are rewarded
        **{f"rollout/{key}": mean(values) for key, values in scores.items() if values},
    }
