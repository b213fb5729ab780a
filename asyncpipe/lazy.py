"""LazyModule: a layer described by a function, built only on the rank that owns it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__: list[str] = []


class LazyModule:
    """A layer that is not built until the rank that owns it asks for it.

    Pass a list of these instead of an ``nn.Sequential`` so that each process only builds (and
    allocates memory for) the layers of its own stage: ``AsyncPipe`` calls the function once,
    on the rank that owns the layer, and no other rank calls it. Reusing one ``LazyModule``
    object at several positions of the list reuses one layer (shared weights), like reusing a
    module.

    With skip connections (:mod:`asyncpipe.skip`) in the model, the other ranks must also know
    the skips of the layers they do not own: each calls the function of every other rank's
    ``LazyModule`` once, under ``torch.device("meta")`` (no tensor memory, no random numbers;
    warnings silenced), only to read the layer's skip declarations. Such a function must then
    run on the meta device (read no tensor values); pass a layer whose function cannot as a
    module. A model without skips never does this.

    Example:
        >>> import torch
        >>> layers = [LazyModule(lambda: torch.nn.Linear(8, 8)) for _ in range(4)]
        >>> layers[0].build()
        Linear(in_features=8, out_features=8, bias=True)
    """

    def __init__(self, function: Callable[[], nn.Module]) -> None:
        if isinstance(function, nn.Module) or not callable(function):
            raise TypeError(
                f"LazyModule takes a function that returns an nn.Module "
                f"(got {type(function).__name__}); write LazyModule(lambda: nn.Linear(8, 8))"
            )
        self.function = function
        self._module: nn.Module | None = None

    def build(self) -> nn.Module:
        """Build the layer (once) and return it."""
        if self._module is None:
            module = self.function()
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"the function of a LazyModule must return an nn.Module "
                    f"(got {type(module).__name__} from {self.function!r})"
                )
            self._module = module
        return self._module

    @property
    def built(self) -> bool:
        """Whether :meth:`build` has run."""
        return self._module is not None

    def __repr__(self) -> str:
        return f"LazyModule({self.function!r}, built={self.built})"
