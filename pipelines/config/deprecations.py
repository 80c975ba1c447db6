"""Config keys renamed in this release: they still work for one release with a one-line
notice (TRL's deprecation path), then go."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from trajflow.deprecations import TrajflowDeprecation

# old key (dotted) -> (new key (dotted), what to do with its value)
RENAMED_KEYS = {
    "ewma.window": "strategy_options.window",
    "ewma.reset_threshold": "strategy_options.reset_threshold",
    "loglinear_alpha": "strategy_options.alpha",
}


def migrate_deprecated_keys(data: dict, default_strategy: str) -> dict:
    """Move renamed keys to their new place (an explicitly given new key wins), saying so once
    per key. A strategy setting goes under `strategy_options` only if the configured strategy
    takes it (it used to be ignored by the others); else it is dropped, and the notice says so."""
    data = dict(data)
    given = data.get("strategy_options")
    if given is not None and not isinstance(given, dict):
        return data  # not a mapping: the field's own validation names the key
    options = dict(given or {})
    accepted = _strategy_parameters(data.get("strategy", default_strategy))
    for old, new in RENAMED_KEYS.items():
        section, _, key = old.rpartition(".")
        holder = data.get(section) if section else data
        if not isinstance(holder, dict) or key not in holder:
            continue
        value = holder.pop(key) if section else data.pop(key)
        if section and not holder:
            data.pop(section)
        option = new.rpartition(".")[2]
        if accepted is not None and option not in accepted:
            notice = f"{old}: ignored (strategy {data.get('strategy')} has no option {option})"
        else:
            notice = f"{old}: use {new}"
            if value is not None:
                options.setdefault(option, value)
        warnings.warn(f"{notice}; the old key goes in the next release", TrajflowDeprecation, stacklevel=2)
    if options:
        data["strategy_options"] = options
    return data


def _strategy_parameters(spec: Any) -> set[str] | None:
    """The keyword parameters of a strategy's constructor (None: it does not resolve yet, the
    strategy field's own validator reports that)."""
    from trajflow.operators.strategies.registry import resolve_strategy

    try:
        cls = resolve_strategy(str(spec))
    except ValueError:
        return None
    return set(inspect.signature(cls.__init__).parameters) - {"self"}
