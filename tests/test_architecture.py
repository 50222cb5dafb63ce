"""Lower layers never import upper ones (ARCHITECTURE.md)."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "tierstore"

LAYER = {
    "errors": 0, "units": 0, "layout": 0, "identity": 0, "keytable": 0, "extras": 0,
    "tiers": 1,
    "io": 2, "fdp": 2, "remote": 2,
    "policies": 3,
    "index": 4, "mover": 4, "metrics": 4,
    "api": 5, "build": 5, "config": 5,
    "trace": 6, "replay": 6, "bench": 6, "integrations": 6, "server": 6, "client": 6, "cli": 6,
    "node": 6,
    "__init__": 7,
}
# files that sit below their package's layer (ARCHITECTURE.md lists them in that lower layer's row):
# the node store's transport halves know nothing of the index; the package's own __init__ stays
# with them, since importing either imports it
FILE_LAYER = {"node/__init__.py": 2, "node/segment.py": 2, "node/protocol.py": 2}
# same-layer imports that ARCHITECTURE.md forbids (the I/O layer never knows FDP's tables; the
# node transport imports layers 0-1 only)
FORBIDDEN_SIDEWAYS = {("io", "fdp"), ("io", "remote"), ("remote", "fdp"),
                      ("node", "io"), ("node", "fdp"), ("node", "remote")}


def top_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def layer_of_file(path: pathlib.Path) -> int:
    return FILE_LAYER.get(path.relative_to(PKG).as_posix(), LAYER[top_of(path)])


def layer_of_module(parts: list[str]) -> int:
    """The layer of ``tierstore.<parts...>`` (a module, or a name imported from one)."""
    if len(parts) > 1 and f"{parts[0]}/{parts[1]}.py" in FILE_LAYER:
        return FILE_LAYER[f"{parts[0]}/{parts[1]}.py"]
    if len(parts) == 1 and f"{parts[0]}/__init__.py" in FILE_LAYER:
        return FILE_LAYER[f"{parts[0]}/__init__.py"]
    return LAYER[parts[0]]


def imported_modules(path: pathlib.Path):
    """``tierstore.<parts>`` of every import of ``path``, as lists of parts (``from m import a``
    gives ``m``'s parts plus ``a``, which may be a submodule)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG)
    depth = len(rel.parts) - 1  # 0 for tierstore/x.py, 1 for tierstore/sub/x.py
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith("tierstore."):
                    base = node.module.split(".")[1:]
                    for a in node.names:
                        yield base + [a.name]
                continue
            up = node.level - 1
            if up > depth:
                continue
            base = [p.removesuffix(".py") for p in rel.parts[:depth - up]]
            mod = (node.module or "").split(".")
            parts = base + [p for p in mod if p]
            for a in node.names:
                yield parts + [a.name]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tierstore."):
                    yield a.name.split(".")[1:]


def imported_tops(path: pathlib.Path):
    for parts in imported_modules(path):
        yield parts[0]


FILES = sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_upward_imports(path):
    me = top_of(path)
    if me not in LAYER:
        pytest.fail(f"{me} is not in the layer table; add it to ARCHITECTURE.md and this test")
    mine = layer_of_file(path)
    for parts in imported_modules(path):
        other = parts[0]
        if other not in LAYER:
            continue
        theirs = layer_of_module(parts)
        if theirs > mine or (theirs == mine and other != me and (me, other) in FORBIDDEN_SIDEWAYS):
            pytest.fail(f"{path.relative_to(PKG)} (layer {mine}) imports {'.'.join(parts)} (layer {theirs})")


def test_files_below_their_package_are_checked_against_the_package_rest():
    """A layer-2 file of node/ importing a layer-6 sibling is caught (the package is not one
    unit for this check), and importing the node package itself means its __init__."""
    assert layer_of_module(["node", "protocol", "Hello"]) == 2
    assert layer_of_module(["node", "client"]) == LAYER["node"] == 6
    assert layer_of_module(["node"]) == 2
    assert layer_of_module(["io", "pages", "FragmentPlan"]) == 2


def _layer_table():
    """``[(layer, module, [files listed])]``, the rows of ARCHITECTURE.md's layer table."""
    import re
    text = (PKG.parent / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.match(r"^\d", cells[0]):
            continue
        layer = int(cells[0].split()[0])
        for name, files in re.findall(r"`([\w_]+)(?:/|\.py)?`(?:\s*\(([^)]*)\))?", cells[1]):
            out.append((layer, name, re.findall(r"`([\w_]+\.py)`", files or "")))
    return out


def test_the_layer_table_of_architecture_md_is_the_one_enforced_here():
    """ARCHITECTURE.md names every module in the layer this test enforces; a package named in
    several layers has its own layer in the highest and the files listed in lower rows are
    FILE_LAYER's; for each package the files listed are the package's files."""
    rows = _layer_table()
    doc: dict = {}
    for layer, name, _ in rows:
        doc[name] = max(doc.get(name, layer), layer)
    code = {m: layer for m, layer in LAYER.items() if m != "__init__"}
    assert doc == code, f"ARCHITECTURE.md {sorted(set(doc.items()) ^ set(code.items()))}"
    lowered = {f"{name}/{f}": layer for layer, name, files in rows if layer < doc[name] for f in files}
    assert lowered == {f: layer for f, layer in FILE_LAYER.items() if not f.endswith("/__init__.py")}
    for layer, name, files in rows:
        if not files:
            continue
        have = sorted(p.name for p in (PKG / name).glob("*.py") if p.name != "__init__.py")
        if layer < doc[name]:
            assert set(files) <= set(have), f"{name}/: ARCHITECTURE.md lists {sorted(files)}, the package has {have}"
            continue
        have = [f for f in have if f"{name}/{f}" not in FILE_LAYER]
        assert sorted(files) == have, f"{name}/: ARCHITECTURE.md lists {sorted(files)}, the package has {have}"
