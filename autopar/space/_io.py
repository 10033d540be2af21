"""`load`: an explored space read back from its JSON Lines file.

JSON Lines rather than Parquet: a row holds nested values (meshes per stage, bytes per
collective kind) that JSON keeps as they are, the file is read by any language without a
library, a small set diffs well under version control, and pyarrow (about 100 MB
installed) would be a dependency for this alone. Pandas reads the file as it is:
``pandas.read_json(path, lines=True)`` (the first line is the header).
"""

from __future__ import annotations

import json
from pathlib import Path

from autopar.space._explore import READABLE_VERSIONS, SCHEMA_VERSION, Space
from autopar.space._rows import COLUMNS


def load(path: str | Path) -> Space:
    """The `Space` written by `Space.write` (or `autopar space --out`) at `path`.

    Raises ValueError naming the problem when the file is missing, is not a space file,
    or was written with another schema version."""
    path = Path(path)
    if path.is_dir():
        path = path / "space.jsonl"
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ValueError(f"no space file at {path}; write one with autopar space --out DIR "
                         "or autopar.space.explore(...).write(path)") from None
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON Lines ({err})") from None
    if not records or records[0].get("record") != "header":
        raise ValueError(f"{path} has no header record first; it was not written by "
                         "autopar.space")
    header, rows = records[0], records[1:]
    version = header.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path} has schema version {version!r}; this autopar reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))} (it writes "
                         f"{SCHEMA_VERSION}): explore the space again to rewrite it")
    for i, row in enumerate(rows, start=2):
        if version == 2 and "lower_bound" not in row:  # a column version 3 added
            row["lower_bound"] = None
        if set(row) != set(COLUMNS):
            missing, extra = sorted(set(COLUMNS) - set(row)), sorted(set(row) - set(COLUMNS))
            raise ValueError(f"{path} line {i} does not have the schema's columns "
                             f"(missing {missing}, unknown {extra})")
    return Space(header, rows)
