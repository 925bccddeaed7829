"""The optimizer wrapper: a real ``torch.optim.Optimizer`` whose update happens only on success.

TorchFT's ``OptimizerWrapper`` idea (torchft/optim.py) with MindSpore's OptTFTWrapper reports: the
gradients were already averaged during ``backward()`` (:mod:`ftrun.rank.reducer`); :meth:`FTOptimizer.step`
applies the wrapped optimizer's update only if every collective of the step succeeded (the rank's
step board says ``update`` meanwhile, :class:`ftrun.rank.client.StepBoard`), and marks the step committed.

It passes ``isinstance(opt, torch.optim.Optimizer)``, so LR schedulers (``StepLR``, ``OneCycleLR``,
``LambdaLR``...), ``GradScaler`` and ``clip_grad_norm_`` take it as they take the optimizer it wraps:
``param_groups``, ``state``, ``defaults``, ``state_dict()``/``load_state_dict()`` and the hook
registration methods are the wrapped optimizer's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from ftrun.rank.worker import Worker


class FTOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; see the module docstring. Create it with ``ft.wrap_optimizer(opt)``.

    ``step()`` returns True when the update was applied, False when the step failed (the update
    is skipped and ``ft.steps()`` recovers and retries the step). With a ``closure`` it returns the
    closure's loss, or None when the update was skipped.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, worker: "Worker") -> None:  # noqa: D107
        # Optimizer.__init__ is not called: every piece of state is the wrapped optimizer's.
        self.__dict__["optimizer"] = optimizer
        self.__dict__["_worker"] = worker

    # The attributes schedulers, GradScaler and clip_grad_norm_ read, shared with the wrapped one.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __getstate__(self) -> dict[str, Any]:
        return self.optimizer.__getstate__()

    def __repr__(self) -> str:
        return f"FTOptimizer({self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Apply the update if the step's collectives succeeded; see the class docstring."""
        applied, loss = self._worker.apply_update(lambda: self.optimizer.step(closure), self.optimizer, closure is not None)
        if closure is None:
            return applied
        return loss if applied else None
