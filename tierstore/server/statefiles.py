"""The daemon's JSON-lines state files (``state_dir/scopes.jsonl``, ``invalidations.jsonl``), read.

tierstore appends one JSON object per line and fsyncs it (:meth:`tierstore.server.tenancy.Tenancy`);
it never rewrites them. A line that is not such a record -- a crash's torn tail, or bytes tierstore did
not write (not UTF-8, not a JSON object, a field missing or of another type, a scope that is not 64 hex
digits) -- is skipped and counted; the file is left as it is. A file with complete lines and not one
record among them is not tierstore's (:func:`foreign_state_file`): start-up refuses it rather than
append to it. An append after a torn tail starts a new line, so the tail never swallows a record.
"""

from __future__ import annotations

import json
import os
import re

#: the fields a ``scopes.jsonl`` record needs (``layout`` is optional: older records lack it)
SCOPE_FIELDS: dict[str, type] = {"scope": str, "owner": str}
#: the fields an ``invalidations.jsonl`` record needs
TOMB_FIELDS: dict[str, type] = {"scope": str, "seq": int}

_DIGEST_HEX = re.compile(r"[0-9a-fA-F]{64}")


def read_state_records(path: str, fields: dict[str, type]) -> tuple[list[dict], int]:
    """The records of one state file, in file order, and the number of lines skipped.

    Parameters
    ----------
    path : str
        The file (absent: no records).
    fields : dict
        Field name -> JSON type every record has (:data:`SCOPE_FIELDS`, :data:`TOMB_FIELDS`);
        ``scope`` must also be a 32-byte digest in hex.

    Returns
    -------
    records : list of dict
    skipped : int
        Lines that are not records (see the module docstring).

    Raises
    ------
    OSError
        If the file exists but cannot be read.
    """
    out: list[dict] = []
    skipped = 0
    if not os.path.exists(path):
        return out, skipped
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError, json.JSONDecodeError
                skipped += 1
                continue
            if not (
                isinstance(rec, dict)
                and all(isinstance(rec.get(k), t) for k, t in fields.items())
                and _DIGEST_HEX.fullmatch(rec["scope"])
            ):
                skipped += 1
                continue
            out.append(rec)
    return out, skipped


def skipped_lines_said(path: str, skipped: int) -> str:
    """The sentence that says ``skipped`` lines of ``path`` were passed over (log and ``--check``)."""
    these = "line of" if skipped == 1 else "lines of"
    verb = "is" if skipped == 1 else "are"
    return (
        f"{skipped} {these} {path} {verb} not a record tierstore wrote (a crash's torn tail, or "
        "bytes it did not write): skipped, the file left as it is"
    )


def ends_mid_line(path: str) -> bool:
    """Whether ``path`` exists, is not empty and its last byte is not a newline (a torn tail).

    Raises
    ------
    OSError
        If the file exists but cannot be read.
    """
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


def foreign_state_file(path: str, records: list[dict], skipped: int) -> str | None:
    """The refusal for a state file tierstore did not write, or ``None`` for one it may append to.

    A file is tierstore's when it is absent or empty, holds at least one record, or holds only a
    torn tail (a crash during the first append: one line without its newline). Any other file
    (complete lines, none a record) is someone else's, and tierstore never writes to it.

    Parameters
    ----------
    path : str
        The state file.
    records, skipped : list of dict, int
        What :func:`read_state_records` returned for it.

    Raises
    ------
    OSError
        If the file exists but cannot be read.
    """
    if records or skipped == 0:
        return None
    if skipped == 1 and ends_mid_line(path):
        return None
    return (
        f"{path}: none of its {skipped} lines is a record tierstore writes, so it is not a tierstore "
        "state file; tierstore appends to this file, and does not write to files it did not create: "
        "move it away or choose another state_dir"
    )
