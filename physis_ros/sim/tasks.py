"""The simulated tasks by name: ``push`` (push a box onto a goal, ``physis_ros.sim.task``)
and ``reach`` (put a 3-joint arm's tool tip on a target, ``physis_ros.sim.reach``). What a
task is: ``physis_ros.sim.base``."""

from __future__ import annotations

from physis_ros.sim.base import Task
from physis_ros.sim.reach import REACH
from physis_ros.sim.task import PUSH

TASKS: dict[str, Task] = {task.name: task for task in (PUSH, REACH)}


def get_task(name: str) -> Task:
    """The task called ``name``; ValueError naming the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None
