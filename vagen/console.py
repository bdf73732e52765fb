"""What a person watching a run in a terminal sees: progress bars on stderr."""

from __future__ import annotations


def progress_bar(total: int, desc: str | None, unit: str, initial: int = 0):
    """A progress bar on stderr with the total, the rate and the time left, or None without `desc`
    (callers that report in their own way, and tests)."""
    if desc is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


class Progress:
    """The training loop's bar: one step per iteration, with the latest success and reward."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.bar = progress_bar(total, "train", "it", initial=start) if enabled else None

    def update(self, it: int, stats: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(success=f"{stats.get('rollout/success', 0):.2f}",
                                 reward=f"{stats.get('rollout/reward_mean', 0):.2f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
