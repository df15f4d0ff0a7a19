"""``nbddp.log`` from where users already log: a Hugging Face ``Trainer`` callback and a Lightning logger.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[nbddp.integrations.NbddpCallback()])
    trainer = pl.Trainer(..., logger=nbddp.integrations.NbddpLogger())

Each rank's numbers reach the cell's charts and ``nbddp.metrics()``, at the trainer's global step. Both log on
every rank (the trainers' own loggers write from rank 0 only: a loss that exists only on the last rank of a
pipeline, or a rank that diverges, would be missed). Each class is made when first asked for, so importing
nbddp imports neither library; outside a ``%%ddp`` cell (a torchrun script) they log nothing.
"""
from __future__ import annotations

import functools
import numbers

from .rank.metrics_log import log


def numeric(metrics: dict) -> dict:
    """The entries of a trainer's logs that are numbers (a tensor of one element counts): name -> float; its
    own ``step``, if it logs one, left out (the step is the trainer's global step)."""
    out = {}
    for name, value in (metrics or {}).items():
        if isinstance(value, bool) or name == "step":
            continue
        if isinstance(value, numbers.Number):
            out[name] = float(value)
        elif getattr(value, "numel", None) is not None and value.numel() == 1:
            out[name] = float(value.item())
    return out


@functools.cache
def _callback():
    from transformers import TrainerCallback

    class NbddpCallback(TrainerCallback):
        """Hugging Face ``Trainer``'s logs (loss, learning rate, grad norm, eval metrics) charted by nbddp, at
        ``state.global_step``: ``Trainer(..., callbacks=[NbddpCallback()])``; ``logging_steps`` says how often."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            found = numeric(logs)
            if found:
                log(step=state.global_step, **found)

    return NbddpCallback


@functools.cache
def _logger():
    try:
        from lightning.pytorch.loggers import Logger
    except ImportError:
        from pytorch_lightning.loggers import Logger

    class NbddpLogger(Logger):
        """Lightning's ``self.log(...)`` charted by nbddp, at the trainer's global step:
        ``pl.Trainer(..., logger=NbddpLogger())`` (or beside others: ``logger=[NbddpLogger(), csv_logger]``)."""

        @property
        def name(self) -> str:
            return "nbddp"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            found = numeric(metrics)
            if found:
                log(step=step, **found)

    return NbddpLogger


def __getattr__(name):
    if name == "NbddpCallback":
        return _callback()
    if name == "NbddpLogger":
        return _logger()
    raise AttributeError(f"module 'nbddp.integrations' has no attribute {name!r}")
