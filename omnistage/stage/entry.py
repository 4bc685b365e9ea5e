"""The target of a spawned stage process, importable without torch: the parent pickles it by
name before it has imported anything heavy; the child imports the stage's code here."""

from __future__ import annotations


def stage_entry(
    config_json: str, in_addr: str, out_addr: str, num_threads: int, startup_json: str = "{}"
) -> None:
    from omnistage.stage.proc import stage_main

    stage_main(config_json, in_addr, out_addr, num_threads, startup_json)
