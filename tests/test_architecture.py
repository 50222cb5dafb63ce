"""Lower layers never import upper ones (ARCHITECTURE.md)."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "tierstore"

LAYER = {
    "errors": 0, "units": 0, "layout": 0, "identity": 0, "keytable": 0, "extras": 0, "registry": 0,
    "tiers": 1,
    "io": 2, "fdp": 2, "remote": 2,
    "policies": 3,
    "index": 4, "mover": 4, "metrics": 4,
    "api": 5, "build": 5, "config": 5,
    "trace": 6, "replay": 6, "bench": 6, "integrations": 6, "server": 6, "client": 6, "cli": 6,
    "__init__": 7,
}
# same-layer imports that ARCHITECTURE.md forbids (the I/O layer never knows FDP's tables)
FORBIDDEN_SIDEWAYS = {("io", "fdp"), ("io", "remote"), ("remote", "fdp")}


def top_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def imported_tops(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG)
    depth = len(rel.parts) - 1  # 0 for tierstore/x.py, 1 for tierstore/sub/x.py
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith("tierstore."):
                    yield node.module.split(".")[1]
                continue
            up = node.level - 1
            if up > depth:
                continue
            base = list(rel.parts[:depth - up])
            mod = (node.module or "").split(".")
            parts = base + [p for p in mod if p]
            if parts:
                yield parts[0]
            else:
                for a in node.names:
                    yield a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tierstore."):
                    yield a.name.split(".")[1]


FILES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_upward_imports(path):
    me = top_of(path)
    if me not in LAYER:
        pytest.fail(f"{me} is not in the layer table; add it to ARCHITECTURE.md and this test")
    for other in imported_tops(path):
        if other not in LAYER or other == me:
            continue
        if LAYER[other] > LAYER[me] or (me, other) in FORBIDDEN_SIDEWAYS:
            pytest.fail(f"{path.relative_to(PKG)} (layer {LAYER[me]}) imports {other} (layer {LAYER[other]})")


def _layer_table():
    """``{layer: {module: [files listed]}}`` from ARCHITECTURE.md's layer table."""
    import re
    text = (PKG.parent / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out: dict = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.match(r"^\d", cells[0]):
            continue
        layer = int(cells[0].split()[0])
        mods = out.setdefault(layer, {})
        for name, files in re.findall(r"`([\w_]+)(?:/|\.py)?`(?:\s*\(([^)]*)\))?", cells[1]):
            mods[name] = re.findall(r"`([\w_]+\.py)`", files or "")
    return out


def test_the_layer_table_of_architecture_md_is_the_one_enforced_here():
    """ARCHITECTURE.md names every module in the layer this test enforces, and
    for each package the files it lists are the package's files."""
    table = _layer_table()
    doc = {m: layer for layer, mods in table.items() for m in mods}
    code = {m: layer for m, layer in LAYER.items() if m != "__init__"}
    assert doc == code, f"ARCHITECTURE.md {sorted(set(doc.items()) ^ set(code.items()))}"
    for mods in table.values():
        for name, files in mods.items():
            if files:
                have = sorted(p.name for p in (PKG / name).glob("*.py") if p.name != "__init__.py")
                assert sorted(files) == have, f"{name}/: ARCHITECTURE.md lists {sorted(files)}, the package has {have}"
