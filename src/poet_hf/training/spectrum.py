"""`SpectrumCallback`: how far training moved the target weights' singular values, in any `transformers.Trainer`."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState

from ..diagnostics import neumann_drift_bound, plot_spectra, singular_values, spectrum_report
from .callback import MergeReinitCallback, unwrap
from .zero import gathered_layer, gathered_rotations

__all__ = ["SpectrumCallback", "SpectrumReport"]


class SpectrumReport(TypedDict):
    """What `SpectrumCallback` reports when training ends (the keys of a pretraining run's ``results.json``)."""

    spectrum_drift: dict[str, float]  # `spectrum_report` of the two snapshots
    spectrum_bound: float | None  # `neumann_drift_bound`; None without POET layers


class SpectrumCallback(TrainerCallback):
    """The target weights' spectra before and after training, their drift and its Cayley–Neumann bound (POET §5).

    POET's rotations keep every singular value of ``W0`` up to the Cayley–Neumann truncation, while full training moves
    them freely. The first snapshot (`singular_values`) is taken once the Trainer is built (``on_init_end``: a ``meta``
    model is materialized by then, and a checkpoint is not yet resumed, so a resumed run measures from the start of
    the run it continues); a callback added later takes it when training begins. When training ends the callback takes
    the second, reports the drift (`spectrum_report`) and its bound (`neumann_drift_bound`, over the merges and the live
    rotations), and plots a few layers into ``args.output_dir/spectra.png`` on the main process (`plot_spectra`).
    Under DeepSpeed ZeRO-3 each layer is read with its parameters gathered (`gathered_layer`).

    Args:
        names: for a model without POET layers, the endings of the module names to read (``q_proj``, …); POET's layers
            are found by type.
        merges: the run's `MergeReinitCallback`, whose merges the bound folds in; ``None``: a run without merges.
        title: the plot's title; ``None``: no plot.

    Attributes:
        before: the first snapshot, ``{module name: singular values}``.
        after: the second, once training has ended.
        report: once training has ended, the `SpectrumReport`; ``None`` before.
    """

    def __init__(
        self, names: list[str] | None = None, merges: MergeReinitCallback | None = None, title: str | None = None
    ) -> None:
        self.names = names
        self.merges = merges
        self.title = title
        self.before: dict[str, torch.Tensor] | None = None
        self.after: dict[str, torch.Tensor] | None = None
        self.report: SpectrumReport | None = None

    def _snapshot(self, model: nn.Module | None) -> dict[str, torch.Tensor]:
        if model is None:
            raise ValueError("`SpectrumCallback` reads the `model` the Trainer passes its callbacks; none was passed")
        return singular_values(unwrap(model), self.names, gathered_layer)

    def on_init_end(self, args, state: TrainerState, control: TrainerControl, model=None, **kwargs):
        self.before = self._snapshot(model)

    def on_train_begin(self, args, state: TrainerState, control: TrainerControl, model=None, **kwargs):
        if self.before is None:
            self.before = self._snapshot(model)

    def on_train_end(self, args, state: TrainerState, control: TrainerControl, model=None, **kwargs):
        self.after = self._snapshot(model)
        assert self.before is not None  # taken at on_init_end or on_train_begin
        with gathered_rotations(unwrap(model)):
            bound = neumann_drift_bound(unwrap(model), self.merges.history if self.merges is not None else [])
        self.report = SpectrumReport(spectrum_drift=spectrum_report(self.before, self.after), spectrum_bound=bound)
        if self.title is not None and state.is_world_process_zero and args.output_dir:
            output = Path(args.output_dir)
            output.mkdir(parents=True, exist_ok=True)
            plot_spectra(self.before, self.after, output / "spectra.png", self.title)
