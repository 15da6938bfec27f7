"""Base classes of every surface's wire models (pydantic)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Requests: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class LenientModel(BaseModel):
    """Nested request objects that clients often echo back with extra keys
    (an assistant message copied from a previous reply, say)."""

    model_config = ConfigDict(extra="ignore")


class WireModel(BaseModel):
    """Responses: serialised with ``exclude_unset``, so an optional field
    (default ``None``) is present exactly when it was set -- to a value or,
    deliberately, to null. Fields with any other default (``object``,
    ``role``) always count as set."""

    model_config = ConfigDict(extra="forbid")

    def model_post_init(self, context: Any, /) -> None:
        for name, spec in type(self).model_fields.items():
            if not spec.is_required() and spec.default is not None:
                self.__pydantic_fields_set__.add(name)

    def to_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)
