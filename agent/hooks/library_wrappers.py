"""Wrappers around library calls no hook reports: GradScaler, gradient clipping, checkpoint.

A GradScaler that skips an update fires no optimizer hook, so `GradScaler.step`/`update` are
wrapped to notice the skip (and the scale before and after). `clip_grad_norm_` is wrapped to warn
when gradients are clipped while still scaled (the seeds' wrong order), and
`torch.utils.checkpoint.checkpoint` to say once that checkpointed regions hide their activations.
Mixed into `Tracker`, whose state (scale, losses, pending alerts, step closing) they update.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from memtui_protocol import schema

CHECKPOINT_NOTES = {
    "non-reentrant": "activation checkpointing (use_reentrant=False) in use: inside "
    "checkpointed regions the checkpoint's own saved-tensor hooks replace memtui's, so "
    "activations kept or recomputed there are not counted",
    "reentrant": "activation checkpointing (use_reentrant=True) in use: checkpointed regions "
    "run their forward without saving activations; backward recomputes them, and memtui counts "
    "what the recomputation saves while backward holds it",
}
"""What each checkpoint variant means for the activations pile (measured on torch 2.13)."""


class LibraryWrappers:
    """The wrapper factories; `Tracker._wrap` installs them and restores the originals.

    The attributes below are the Tracker state they share (declared here for readers); the
    methods they call back (`close_step`, `_on_new_objects`, `_disable`) are Tracker's.
    """

    _scaled_loss: tuple[int, Any] | None
    _scale: Any
    _held_skip: tuple[Any, Any] | None
    optimizers: Any
    _scaled_backward: bool
    _unscaled: bool
    _warned_clip: bool
    _noted_checkpoint: set[str]
    _in_optimizer: bool
    closed_steps: int
    enabled: dict[str, bool]
    pending_alerts: list[schema.Alert]
    registry: Any
    _emit: Callable[[Any], None]

    def _wrap_scaler_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scale(scaler: Any, outputs: Any) -> Any:
            result = original(scaler, outputs)
            try:
                if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
                    self._scaled_loss = (id(result), outputs.detach())
            except Exception:
                pass
            return result

        return scale

    def _wrap_scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            record = self.optimizers.get(optimizer)
            steps_before = record.steps if record is not None else 0
            try:
                # The scale this step's backward used; `update()` changes it in place later,
                # and the step may close inside `original` (the optimizer's post hook).
                if scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
                    self._scale = scaler._scale.detach().clone()
            except Exception as exc:
                self._disable("scaler", exc)
            result = original(scaler, optimizer, *args, **kwargs)
            try:
                record = self.optimizers.get(optimizer)
                stepped = record is not None and record.steps != steps_before
                if not stepped and self.enabled["steps"]:
                    # Skipped: no optimizer hook fired. The step closes now (so the next
                    # optimizer's frame does not take its window) and is emitted at update(),
                    # which knows the scale after the skip.
                    if self.registry.add_optimizer(optimizer):
                        self._on_new_objects()
                    self._steps_close_at_optimizer()
                    self._in_optimizer = False
                    closed = self.close_step(
                        skipped=True, record=self.optimizers.count_step(optimizer)
                    )
                    self._held_skip = (closed, scaler)
            except Exception as exc:
                self._disable("steps", exc)
            return result

        return step

    def _wrap_scaler_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(scaler, *args, **kwargs)
            held = self._held_skip
            if held is not None and held[1] is scaler:
                try:
                    held[0].scale_after = scaler._scale.detach().clone()
                except Exception:
                    pass
                self.release_held_skip()
            return result

        return update

    def _wrap_scaler_unscale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def unscale_(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            self._unscaled = True
            return original(scaler, *args, **kwargs)

        return unscale_

    def _wrap_clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def clip(*args: Any, **kwargs: Any) -> Any:
            if self._scaled_backward and not self._unscaled and not self._warned_clip:
                self._warned_clip = True
                self.pending_alerts.append(
                    schema.Alert(
                        kind="clip_before_unscale",
                        message=f"{original.__name__} ran on gradients still multiplied by the "
                        "GradScaler's scale: call scaler.unscale_(optimizer) first, or the "
                        "clipping threshold applies to scaled gradients",
                        where=original.__name__,
                    )
                )
            return original(*args, **kwargs)

        return clip

    def _wrap_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def checkpoint(*args: Any, **kwargs: Any) -> Any:
            # torch 2.x treats a missing use_reentrant as True (with a warning).
            reentrant = kwargs.get("use_reentrant")
            variant = "reentrant" if reentrant is None or reentrant else "non-reentrant"
            if variant not in self._noted_checkpoint:
                self._noted_checkpoint.add(variant)
                self._emit(
                    schema.AlertNow(
                        time=time.time(),
                        step=self.closed_steps + 1,
                        alert=schema.Alert(
                            kind="checkpoint_limit", message=CHECKPOINT_NOTES[variant]
                        ),
                    )
                )
            return original(*args, **kwargs)

        return checkpoint
