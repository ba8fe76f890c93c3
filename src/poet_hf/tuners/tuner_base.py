"""`LayerReplacingTuner`, the PEFT tuner base of the POET, OFT and orthogonal-layer tuners."""

from __future__ import annotations

from typing import Any, cast

from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner
from torch import nn


class LayerReplacingTuner(BaseTuner):
    """A PEFT tuner that wraps each target in a layer of ``tuner_layer_cls``, or adds the adapter to one already there.

    A subclass makes its layers in `create_layer`, and may act on each in `after_layer_added`.
    """

    def create_layer(self, config: Any, adapter_name: str, target: nn.Module, layer_name: str) -> Any:
        """A new tuner layer around ``target``; raises a ``ValueError`` naming a type the tuner cannot wrap."""
        raise NotImplementedError

    def after_layer_added(self, layer: nn.Module, adapter_name: str, layer_name: str) -> None:
        """Called once an adapter is on the layer of ``layer_name``, new or not."""

    def _create_and_replace(
        self,
        peft_config: PeftConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        parameter_name: str | None = None,
        **optional_kwargs: Any,
    ) -> None:
        if current_key is None:
            raise ValueError("current_key must not be None")
        if isinstance(target, self.tuner_layer_cls):
            cast(Any, target).update_layer(adapter_name, peft_config, layer_name=current_key)
            self.after_layer_added(target, adapter_name, current_key)
            return
        new_module = self.create_layer(peft_config, adapter_name, target, current_key)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)
        self.after_layer_added(new_module, adapter_name, current_key)
