"""The contracts every phase speaks: configuration, layout, record, wire, specs, errors.

Pydantic models and constants only: nothing here imports Docker, the guard, or any
copy, mount or diff mechanism, so every other part (and a reader of the record) can
import them without pulling in a mechanism.
"""
