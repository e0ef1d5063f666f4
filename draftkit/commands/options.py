"""Option values shared by the verbs."""

from __future__ import annotations


def comma_list(value: str | list[str] | None) -> list[str] | None:
    """An option that takes one or several names (``--dtype float32``, ``--dtype float32,bfloat16``, or the list
    a recipe or Python gives): the names, stripped, empty ones dropped; None stays None."""
    if isinstance(value, str):
        return [x.strip() for x in value.split(",") if x.strip()]
    return value
