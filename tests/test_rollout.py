"""The supervisor's rolling reload: one worker at a time, the next once the one before shows its
reload done in its published figures (or is gone, or took too long)."""

from __future__ import annotations

from pathlib import Path

from proxy.filewatch import file_digest
from proxy.rollout import WORKER_RELOAD_LIMIT_S, Rollout
from proxy.telemetry.metricstate import MetricState


class _Workers:
    """Fake workers: their published files, and the SIGHUPs sent to them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.told: list[int] = []
        self.now = 0.0

    def publish(self, pid: int, version: str, reloads: int = 0) -> None:
        state = MetricState()
        state.policy = {(version,): 1}
        state.reloads = {("refused",): reloads} if reloads else {}
        (self.directory / f"{pid}-0000.json").write_bytes(state.dump())

    def rollout(self, config: Path) -> Rollout:
        return Rollout(config, self.directory, clock=lambda: self.now, send=self.told.append)


def test_workers_reload_one_at_a_time(tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text("a new version\n")
    new = file_digest(config.read_bytes())
    workers = _Workers(tmp_path)
    for pid in (1, 2, 3):
        workers.publish(pid, "old")
    rollout = workers.rollout(config)
    rollout.begin([1, 2, 3])
    rollout.step({1, 2, 3})
    assert workers.told == [1]
    rollout.step({1, 2, 3})
    assert workers.told == [1]  # not done yet: the others serve meanwhile
    workers.publish(1, new)
    rollout.step({1, 2, 3})
    assert workers.told == [1, 2]
    workers.publish(2, "old", reloads=1)  # it refused the file: done too
    rollout.step({1, 2, 3})
    assert workers.told == [1, 2, 3]
    rollout.step({1, 2})  # it died meanwhile: nothing left to wait for
    rollout.step({1, 2})
    assert workers.told == [1, 2, 3]


def test_a_worker_serving_the_file_is_passed_over_and_a_new_one_is_reloaded(
    tmp_path: Path,
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text("a new version\n")
    new = file_digest(config.read_bytes())
    workers = _Workers(tmp_path)
    workers.publish(1, new)  # it took the admin reload itself
    workers.publish(2, "old")
    rollout = workers.rollout(config)
    rollout.begin([1, 2])
    rollout.step({1, 2})
    assert workers.told == [2]
    rollout.step({1, 4})  # 2 died; 4 started in its place, maybe from the old policy
    assert workers.told == [2, 4]
    workers.now += WORKER_RELOAD_LIMIT_S  # 4 never shows it done: the rollout ends anyway
    rollout.step({1, 4})
    rollout.step({1, 4, 5})  # over: a worker started now takes the policy the others accepted
    assert workers.told == [2, 4]
