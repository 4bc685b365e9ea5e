"""The synchronous ``Omni`` wrapper's own lifecycle (its engine is a stand-in here)."""

import psutil

from omnistage.entrypoints.omni import Omni


class StandInEngine:
    def shutdown(self) -> None:
        pass


def test_shutdown_releases_the_private_event_loop():
    process = psutil.Process()
    Omni(StandInEngine()).shutdown()  # warm-up: lazily opened descriptors
    before = process.num_fds()
    for _ in range(5):
        Omni(StandInEngine()).shutdown()
    assert process.num_fds() == before
