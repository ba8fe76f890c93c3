"""What the POET, OFT and orthogonal-layer tuners share with PEFT: `LayerReplacingTuner`, their tuner base;
`ModuleMixin`, PEFT's layer mixins as the type checker should see them; `base_model_of`, the model under PEFT;
`get_peft_model_quietly`, PEFT's wrapping without the warning PEFT's own read raises."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol, cast

from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from peft import PeftModel
    from torch.utils.hooks import RemovableHandle
    from transformers import PreTrainedModel
    from typing_extensions import Self

    class ModuleMixin:
        """PEFT builds a tuner layer as ``class Linear(nn.Module, XLayer)``: the mixin ``XLayer`` calls ``nn.Module``'s
        methods but does not derive from it. To the type checker `ModuleMixin` carries those methods (``nn.Module``'s
        own, so the concrete layers see no conflict between their bases); at run time it is an empty class, so no
        layer's method resolution order changes."""

        training: bool

        def named_children(self) -> Iterator[tuple[str, nn.Module]]: ...

        def register_load_state_dict_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle: ...

        def train(self, mode: bool = True) -> Self: ...

        def requires_grad_(self, requires_grad: bool = True) -> Self: ...

else:

    class ModuleMixin:
        pass


def base_model_of(model: nn.Module) -> Any:
    """The model under PEFT: ``model.get_base_model()`` for a ``PeftModel``, else ``model`` itself.

    Typed as ``Any``: usually a ``transformers`` model (``get_input_embeddings``, ``config``…), but any module works.
    """
    get_base_model = getattr(model, "get_base_model", None)
    return model if get_base_model is None else get_base_model()


def get_peft_model_quietly(model: nn.Module, config: PeftConfig, **kwargs: Any) -> PeftModel:
    """``peft.get_peft_model(model, config, **kwargs)`` without transformers 5's ``FutureWarning`` about
    ``is_gradient_checkpointing``.

    PEFT reads that deprecated property of every model it wraps; the warning names PEFT's read, not the caller's, and
    nothing the caller changes silences it. Only that warning is held back, and only for this call.
    """
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return cast("PeftModel", get_peft_model(cast("PreTrainedModel", model), config, **kwargs))


class AdapterHolder(Protocol):
    """A tuner layer, which takes one more adapter in place."""

    def update_layer(self, adapter_name: str, config: PeftConfig, layer_name: str) -> None: ...


class LayerReplacingTuner(BaseTuner):
    """A PEFT tuner that wraps each target in a layer of ``tuner_layer_cls``, or adds the adapter to one already there.

    A subclass makes its layers in `create_layer`, and may act on each in `after_layer_added`.
    """

    def create_layer(self, config: PeftConfig, adapter_name: str, target: nn.Module, layer_name: str) -> BaseTunerLayer:
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
            cast(AdapterHolder, target).update_layer(adapter_name, peft_config, layer_name=current_key)
            self.after_layer_added(target, adapter_name, current_key)
            return
        new_module = cast(
            nn.Module, self.create_layer(peft_config, adapter_name, target, current_key)
        )  # nn.Module and the mixin
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)
        self.after_layer_added(new_module, adapter_name, current_key)
