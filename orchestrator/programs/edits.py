"""The model's edits: search/replace blocks, checked and applied before anything runs.

    files = apply(spec, read=lambda f: repo.show(parent, spec.repo_path(f)), edits=[
        {"file": "train.py", "search": "lr = 1e-3", "replace": "lr = 2e-3"}])

Refused, with a reason the model gets back (`EditRejected`): a file outside `edit`, a protected file, an empty
`search`, a `search` that does not occur exactly once in the file as it is after the earlier blocks, a
proposal whose replacement text is over the size limit, and Python that does not compile.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Callable, Sequence

from orchestrator.core.errors import OrchestratorError
from orchestrator.programs.spec import ProgramSpec

MAX_EDITS = 20


class EditRejected(OrchestratorError):
    """A proposal's edits cannot be applied; the message is the reason sent back to the model."""


def _name(spec: ProgramSpec, raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise EditRejected("every edit needs a \"file\"")
    name = PurePosixPath(raw.strip().removeprefix("./")).as_posix()
    if name in spec.protected:
        raise EditRejected(f"{name} is protected (data and evaluation): it must not be edited")
    if name not in spec.edit:
        raise EditRejected(f"{name} is not editable; only {', '.join(spec.edit)} may change")
    return name


def apply(spec: ProgramSpec, read: Callable[[str], str | None], edits: Sequence[Any]) -> dict[str, str]:
    """The new text of every file the edits change (program-relative names), or EditRejected."""
    if not isinstance(edits, list) or not edits:
        raise EditRejected("\"edits\" must be a non-empty list of {file, search, replace}")
    if len(edits) > MAX_EDITS:
        raise EditRejected(f"at most {MAX_EDITS} edits per proposal, got {len(edits)}")
    size = sum(len(e.get("replace") or "") for e in edits if isinstance(e, dict))
    if size > spec.max_edit_chars:
        raise EditRejected(f"the edits add {size} characters; the limit is {spec.max_edit_chars}")
    files: dict[str, str] = {}
    for i, edit in enumerate(edits):
        if not isinstance(edit, dict):
            raise EditRejected(f"edit {i}: expected an object with file, search and replace")
        name = _name(spec, edit.get("file"))
        search, replace = edit.get("search"), edit.get("replace", "")
        if not isinstance(search, str) or not search:
            raise EditRejected(f"edit {i} ({name}): \"search\" must be non-empty text copied from the file")
        if not isinstance(replace, str):
            raise EditRejected(f"edit {i} ({name}): \"replace\" must be text")
        if name not in files:
            text = read(name)
            if text is None:
                raise EditRejected(f"edit {i}: {name} does not exist in the parent commit")
            files[name] = text
        count = files[name].count(search)
        if count != 1:
            where = "does not occur" if count == 0 else f"occurs {count} times"
            raise EditRejected(f"edit {i} ({name}): the search text {where} in the file; it must occur exactly "
                               f"once (copy it exactly, with enough context to be unique)")
        files[name] = files[name].replace(search, replace, 1)
    for name, text in files.items():
        if name.endswith(".py"):
            try:
                compile(text, name, "exec")
            except SyntaxError as exc:
                raise EditRejected(f"{name} does not compile after the edits: {exc.msg} at line {exc.lineno}") \
                    from None
            except ValueError as exc:  # e.g. a NUL byte
                raise EditRejected(f"{name} does not compile after the edits: {exc}") from None
    return files
