"""PEFT's layer mixins, as the type checker should see them.

PEFT builds a tuner layer as ``class Linear(nn.Module, XLayer)``: the mixin ``XLayer`` calls ``nn.Module``'s methods
but does not derive from it. To the type checker `ModuleMixin` carries those methods (``nn.Module``'s own, so the
concrete layers see no conflict between their bases); at run time it is an empty class, so no layer's method
resolution order changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from torch.utils.hooks import RemovableHandle
    from typing_extensions import Self

    class ModuleMixin:
        training: bool

        def named_children(self) -> Iterator[tuple[str, nn.Module]]: ...

        def register_load_state_dict_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle: ...

        def train(self, mode: bool = True) -> Self: ...

        def requires_grad_(self, requires_grad: bool = True) -> Self: ...

else:

    class ModuleMixin:
        pass
