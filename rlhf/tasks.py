"""reasoning-gym procedural tasks: the data source ``data.path: reasoning_gym:<task>`` and what its verifier needs.

A generator is fixed by its task name, seed, size and options (the task's config fields); entry ``i`` of the same
generator is the same problem everywhere. Each prompt's label is a JSON object naming that generator and the index
(plus the reference answer, for reading), so the reward service's ``reasoning_gym`` rule rebuilds the generator,
takes entry ``i`` and scores the response with the task's own ``score_answer``: no data set is downloaded or shared
between the trainer and the reward service.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

LABEL_KEY = "reasoning_gym"
INSTALL = "pip install 'rlhf-pipeline[tasks]' (the reasoning-gym package)"


def _module():
    try:
        import reasoning_gym  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise ImportError(f"reasoning_gym tasks need the reasoning-gym package: {INSTALL}") from None
    return reasoning_gym


def task_names() -> list[str]:
    return sorted(_module().factory.DATASETS)


@lru_cache(maxsize=64)
def _cached(task: str, seed: int, size: int, options_json: str):
    rg = _module()
    if task not in rg.factory.DATASETS:
        raise KeyError(task)
    return rg.create_dataset(task, seed=seed, size=size, **json.loads(options_json))


def generator(task: str, seed: int, size: int, options: dict[str, Any]):
    """The reasoning-gym data set (built once per distinct generator). Raises KeyError for an unknown task and
    whatever the task's config raises (TypeError, ValueError, AssertionError) for bad options."""
    for reserved in ("seed", "size"):
        if reserved in options:
            raise ValueError(f"{reserved!r} is not a task option here: set data.generator_{reserved}")
    return _cached(task, int(seed), int(size), json.dumps(options, sort_keys=True))


def make_label(task: str, seed: int, size: int, options: dict[str, Any], index: int, answer: Any) -> str:
    """The label carried by prompt ``index``: everything the verifier needs to recover the generator's entry."""
    return json.dumps(
        {LABEL_KEY: task, "seed": seed, "size": size, "options": options, "index": index, "answer": answer},
        sort_keys=True,
    )


def entry_for_label(label: str) -> tuple[Any, dict[str, Any]]:
    """(data set, entry) named by a label made by :func:`make_label`; ValueError saying what is wrong otherwise."""
    try:
        spec = json.loads(label)
    except (TypeError, ValueError):
        raise ValueError("label is not a reasoning_gym label (JSON from data.path: reasoning_gym:<task>)") from None
    if not isinstance(spec, dict) or LABEL_KEY not in spec:
        raise ValueError(f"label has no {LABEL_KEY!r} key: it must come from data.path: reasoning_gym:<task>")
    try:
        task, seed, size, index = spec[LABEL_KEY], int(spec["seed"]), int(spec["size"]), int(spec["index"])
        options = dict(spec.get("options") or {})
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"reasoning_gym label lacks or mangles {err}") from None
    if not 0 <= index < size:
        raise ValueError(f"reasoning_gym label index {index} is outside the generator's size {size}")
    try:
        ds = generator(task, seed, size, options)
    except KeyError:
        raise ValueError(f"reasoning_gym label names an unknown task {task!r}") from None
    return ds, ds[index]
