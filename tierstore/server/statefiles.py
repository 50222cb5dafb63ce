"""The daemon's JSON-lines state files (``state_dir/scopes.jsonl``, ``invalidations.jsonl``), read.

tierstore appends one JSON object per line and fsyncs it (:meth:`tierstore.server.tenancy.Tenancy`);
it never rewrites them. A line that is not such a record -- a crash's torn tail, or bytes tierstore did
not write (not UTF-8, not a JSON object, a field missing or of another type, a scope that is not 64 hex
digits) -- is skipped and counted; the file is left as it is.
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
