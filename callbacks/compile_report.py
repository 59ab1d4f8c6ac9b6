"""CompileReport: once, after the first training step, what torch.compile did (the Trainer adds it with `compile`):
the time to that step, cold or warm from the compile cache, each graph break with its file:line and why, and each
recompilation. The run summary (ModelSummary) shows the same at the fit's end."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from torchyard.callbacks.base import Callback

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


class CompileReport(Callback):
    """Prints (rank 0) the strategy's compile record once the first optimizer step has run."""

    def __init__(self) -> None:
        self._reported = False

    @override
    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._reported = False

    @override
    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._reported:
            return
        record = trainer.strategy.compile_record
        if record is None or trainer.batches_stepped == 0:  # a micro-batch that accumulates: no step yet
            return
        self._reported = True
        record.first_step()
        if trainer.is_global_zero:
            print("\n".join(record.report_lines()), flush=True)
