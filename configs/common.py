"""Helpers shared by the config files: preset argument strings like "n=16,steps=50"."""
from __future__ import annotations


def parse_arg(arg: str | None, allowed: dict[str, type]) -> dict:
    """Parses `get_config`'s argument string "key=value,key=value" into typed values.

    Unknown preset keys stop with a message listing the allowed ones.
    """
    out = {}
    if not arg:
        return out
    for item in arg.split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"config preset argument {item!r} must look like key=value; "
                             f"allowed keys: {', '.join(sorted(allowed))}.")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in allowed:
            raise ValueError(f"unknown config preset key {key!r}; allowed: "
                             f"{', '.join(sorted(allowed))}.")
        try:
            out[key] = allowed[key](value)
        except ValueError:
            raise ValueError(f"config preset argument {key!r} must be {allowed[key].__name__}, "
                             f"got {value!r} (in {arg!r}).") from None
    return out
