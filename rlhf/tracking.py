"""Experiment tracking: what a user of TRL or OpenRLHF looks at during a run.

:class:`Tracker` writes TensorBoard event files in ``<run_dir>/tensorboard`` when ``tensorboard`` is installed (the
``plots`` extra; the service images leave it out, and a run without it says so once in its log), Weights & Biases as
well when ``wandb`` is installed and ``WANDB_PROJECT`` is set, and a few samples every
``training.log_completions_interval`` steps to ``<run_dir>/completions.jsonl``. Both trackers are optional copies:
metrics.jsonl, which the trainer writes itself, has every metric. A trainer resuming from step N passes
``resume_step=N``: TensorBoard hides the events after it, as metrics.jsonl is cut back. Design:
docs/running.md#the-run-folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger("rlhf.tracking")


class Tracker:
    def __init__(self, run_dir: str | Path, run_id: str, config: Mapping[str, Any], resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.tb = _tensorboard(self.run_dir / "tensorboard", resume_step)
        self.wandb = None
        if os.environ.get("WANDB_PROJECT"):
            try:
                import wandb
            except ImportError:
                log.warning("WANDB_PROJECT is set but the wandb package is not installed: no Weights & Biases run")
            else:
                self.wandb = wandb.init(
                    project=os.environ["WANDB_PROJECT"],
                    name=run_id,
                    id=run_id,
                    resume="allow",
                    config=dict(config),
                    dir=str(self.run_dir),
                )
        self._completions = self.run_dir / "completions.jsonl"
        self._eval_defined = False
        if resume_step:
            _cut_completions(self._completions, resume_step)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        scalars = self._scalars(metrics, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_eval(self, metrics: Mapping[str, Any], step: int) -> None:
        """``eval/*`` metrics of ``step``, written when the evaluation beside training ends (later steps may be logged
        already): TensorBoard takes any step; W&B plots them against their own step metric ``eval/step``, since
        ``wandb.log`` drops a step below the current one."""
        scalars = self._scalars(metrics, step)
        if self.wandb is not None:
            if not self._eval_defined:
                self.wandb.define_metric("eval/step")
                self.wandb.define_metric("eval/*", step_metric="eval/step")
                self._eval_defined = True
            self.wandb.log({"eval/step": step, **scalars})

    def _scalars(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """The finite numbers of ``metrics`` (``step`` aside), written to TensorBoard when it is on."""
        scalars = {k: float(v) for k, v in metrics.items() if _number(v) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        return scalars

    def completions(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """A table of sample completions of ``step`` (dicts with prompt, response, reward, ...)."""
        if not rows:
            return
        with open(self._completions, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        cols = list(rows[0])
        table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        table += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
        if self.tb is not None:
            self.tb.add_text("completions", "\n".join(table), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log(
                {"completions": wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])}, step=step
            )

    def close(self, exit_code: int | None = None) -> None:
        """Flush and close; ``exit_code``: the trainer's, when the run ended without success (wandb marks it failed)."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish(exit_code=exit_code)
            # finish() can return before wandb's service has written the run's records (offline: the .wandb file held
            # only its header once); teardown waits for the service, so the run is on disk when the trainer exits.
            wandb.teardown()


def _tensorboard(directory: Path, resume_step: int) -> SummaryWriter | None:
    """A ``SummaryWriter`` on ``directory``, or None (logged) when tensorboard is not installed. Not a config switch:
    the event files are a copy of metrics.jsonl, so a run does not fail for want of them, as W&B does not."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # loads torch: a tracker is made when training starts
    except ImportError:
        log.warning(
            "tensorboard is not installed: no TensorBoard event files in %s (metrics.jsonl has every metric; "
            "pip install 'rlhf-pipeline[plots]' adds them)",
            directory,
        )
        return None
    return SummaryWriter(str(directory), purge_step=resume_step + 1 if resume_step else None)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _cell(v: Any) -> str:
    text = f"{v:.4f}" if isinstance(v, float) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def _cut_completions(path: Path, step: int) -> None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
