"""The default of the models' list fields: a new empty list from a Python function.

Not `Field(default_factory=list)`: pydantic asks every default factory for its signature
(does it take the validated data?) when it builds a model, and a builtin type's is parsed
from its text signature by the tokenizer, about 0.1-0.2 ms a field; a Python function's is
read from its code. The runner builds some thirty such fields at every start of
`sandbox run`. What a field validates, dumps and puts in the JSON schema is the same.
"""

from __future__ import annotations

from typing import Any


def empty_list() -> list[Any]:
    """A new, empty list (each model gets its own)."""
    return []
