"""Config keys renamed in this release: they still work for one release with a one-line
notice (TRL's deprecation path), then go."""

from __future__ import annotations

import warnings
from typing import Any

from trajflow.deprecations import TrajflowDeprecation
from trajflow.operators.strategies.registry import STRATEGIES
from trajflow.registry import settings_keys

# old key (dotted) -> its new place: a setting of the configured strategy (`strategy: {name: NAME, <settings>}`)
RENAMED_KEYS = {
    "ewma.window": "strategy.window",
    "ewma.reset_threshold": "strategy.reset_threshold",
    "loglinear_alpha": "strategy.alpha",
}
STRATEGY_FORM = "strategy: {name: NAME, <its settings>}"


def migrate_deprecated_keys(data: dict, default_strategy: str) -> dict:
    """Move renamed keys to their new place (an explicitly given new key wins), saying so once
    per key, and split `strategy: {name: NAME, <settings>}` into the strategy's name and its
    settings (`strategy_options`, where the config holds them). A strategy setting under an old
    key is kept only if the configured strategy declares it (it used to be ignored by the
    others); else it is dropped, and the notice says so."""
    data = dict(data)
    given = data.get("strategy_options")
    if given is not None and not isinstance(given, dict):
        return data  # not a mapping: the field's own validation names the key
    if given is not None:
        warnings.warn(f"strategy_options: use {STRATEGY_FORM}; the old key goes in the next release",
                      TrajflowDeprecation, stacklevel=2)
    name, settings = STRATEGIES.split(data.get("strategy", default_strategy))
    options = {**(given or {}), **settings}
    accepted = _strategy_settings(name)
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
            notice = f"{old}: ignored (strategy {name} has no setting {option})"
        else:
            notice = f"{old}: use {new}"
            if value is not None:
                options.setdefault(option, value)
        warnings.warn(f"{notice}; the old key goes in the next release", TrajflowDeprecation, stacklevel=2)
    if "strategy" in data:
        data["strategy"] = name
    if options or given is not None:
        data["strategy_options"] = options
    return data


def _strategy_settings(spec: Any) -> set[str] | None:
    """The setting keys the strategy declares (None: it does not resolve yet, the strategy
    field's own validator reports that)."""
    try:
        settings = STRATEGIES.settings_class(str(spec))
    except ValueError:
        return None
    return set(settings_keys(settings)) if settings is not None else set()
