"""Names from a closed set (states, kinds, actions) as enums that are written as their value everywhere they
go: the API, persisted files, the log, metric labels."""

from __future__ import annotations

from enum import Enum


class Named(str, Enum):
    """A name from a closed set: str() and f-strings give its value, as JSON does (enum.StrEnum does
    so too, but only from Python 3.11; a plain (str, Enum) formats as "Cls.NAME" there)."""

    __str__ = str.__str__
    __format__ = str.__format__
