"""Records kept as plain JSON dicts in a checkpoint or a table: the agent's and program mode's trials.

`Record` gives a dataclass the two operations both need: `update` (several fields at once, then the record's
own coercions in `__post_init__`, so enum fields given as words become members) and `from_dict` (a record from
its stored dict, ignoring keys it does not know, so a row written by another version still loads)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

R = TypeVar("R", bound="Record")


class Record:
    """A base for dataclass records; subclasses coerce their fields in `__post_init__`."""

    def __post_init__(self) -> None:
        pass

    def update(self: R, **changes: Any) -> R:
        """Set several fields at once (values given as words are coerced as at construction)."""
        for k, v in changes.items():
            if not hasattr(self, k):
                raise AttributeError(f"{type(self).__name__} has no field {k!r}")
            setattr(self, k, v)
        self.__post_init__()
        return self

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """A record from its stored dict (unknown keys, from another version, are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
