"""Ceilings are facts: an explicit cap and the model's declared maximum, never free memory."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import KvConfigError


@dataclass(frozen=True, slots=True)
class HardMax:
    """A session's resolved token ceiling and where it came from."""

    value: int | None
    source: str
    model_max: int | None = None

    def describe(self) -> str:
        return "unbounded" if self.value is None else str(self.value)


def resolve_hard_max(
    explicit_cap: int | None,
    model_max: int | None,
    *,
    cap_label: str = "explicit cap",
    model_label: str = "model max_length",
) -> HardMax:
    """An explicit cap clamped by the model's maximum; else the model's; else unbounded.

    ``cap_label`` names where the cap came from in ``source`` (for example
    ``"config kv.max_len"`` or ``"item max_context"``); ``model_label`` where
    the model's maximum did.
    """
    for name, value in (("explicit cap", explicit_cap), ("model max_length", model_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise KvConfigError(f"{name} must be an integer, got {value!r}")
        if value is not None and value <= 0:
            raise KvConfigError(f"{name} must be positive, got {value}")
    if explicit_cap is not None:
        if model_max is not None and explicit_cap > model_max:
            return HardMax(
                model_max,
                f"{cap_label} {explicit_cap} clamped by {model_label} ({model_max})",
                model_max,
            )
        return HardMax(explicit_cap, f"{cap_label} {explicit_cap}", model_max)
    if model_max is not None:
        return HardMax(model_max, f"{model_label} ({model_max})", model_max)
    return HardMax(None, "unbounded (model declares no maximum)", None)
