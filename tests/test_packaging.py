"""The core install: a wheel with only the core dependencies in an empty venv (issue 22, item 12).

What an engine imports (``tierstore``, ``KVStore``, the modules the connectors import) and the
README's first command (``tierstore bench --rw=kvtrace``) work without matplotlib, rich, aiohttp,
prometheus-client or sh; the features that need them say which extra to install. The wheel is
built from this checkout (``pip wheel --no-deps``), installed into a new venv without system
site-packages; pip resolves the rest from the wheel's metadata, as a user's ``pip install tierstore``
does. torch is the one exception: the venv sees the running interpreter's torch (the README's pinned
``torch==2.13.0``) through links to its packages and its ``.dist-info``, so pip finds the requirement
met instead of unpacking ~200 MB again (that took 90-110 s of this test on the 2-core VM, a twentieth
of CI); torch's own small dependencies are still resolved by pip.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONAL = ("matplotlib", "rich", "aiohttp", "prometheus_client", "sh")
CONNECTORS = (
    "tierstore/integrations/vllm.py",
    "tierstore/integrations/sglang.py",
    "tierstore/integrations/vllm_offload.py",
    "tierstore/integrations/hf.py",
)


def _tierstore_imports_of(path: pathlib.Path) -> set[str]:
    """The tierstore modules a file imports at module level (``from ..api import KVStore`` ->
    tierstore.api)."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            out.add(".".join(base + ([node.module] if node.module else [])))
    return out


def _run(args, **kw) -> subprocess.CompletedProcess:
    """Run ``args``; without PYTHONPATH, so that the venv imports its installed wheel, not this checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, **kw)


def _link_running_torch(py: pathlib.Path, link_dir: pathlib.Path) -> None:
    """Make this interpreter's torch (packages and ``.dist-info``, no other distribution) importable
    and visible to pip in the venv of ``py``: symbolic links in ``link_dir``, named by a ``.pth``
    file in the venv's site-packages (module docstring)."""
    import importlib.metadata as md

    dist = md.distribution("torch")
    site = pathlib.Path(str(dist.locate_file("")))
    tops = {pathlib.PurePosixPath(str(f)).parts[0] for f in dist.files or ()} - {".."}
    link_dir.mkdir()
    for top in sorted(tops):
        (link_dir / top).symlink_to(site / top)
    p = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    assert p.returncode == 0, p.stderr
    (pathlib.Path(p.stdout.strip()) / "_running_torch.pth").write_text(f"{link_dir}\n")


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("core-install")
    p = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp),
            str(ROOT),
        ]
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = tmp.glob("tierstore-*.whl")
    venv = tmp / "venv"
    p = _run([sys.executable, "-m", "venv", str(venv)])
    assert p.returncode == 0, p.stderr
    py = venv / "bin" / "python"
    _link_running_torch(py, tmp / "torch-link")
    p = _run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheel)])
    if p.returncode != 0 and "No matching distribution found for torch" in p.stderr:
        pytest.skip(f"torch==2.13.0 cannot be installed here: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr[-3000:]
    return venv


@pytest.mark.slow
def test_core_install_imports_stores_and_loads_without_the_extras(core_venv, tmp_path):
    mods = sorted(set().union(*(_tierstore_imports_of(ROOT / c) for c in CONNECTORS)) | {"tierstore.replay"})
    assert "tierstore.api" in mods and "tierstore.integrations._common" in mods
    script = textwrap.dedent(f"""
        import importlib, json, sys
        import numpy as np, torch
        import tierstore
        from tierstore import KVStore, Namespace, get_layout, leading_ok
        lay = get_layout("tiny")
        s = KVStore(lay, host_bytes=2 * lay.bytes_per_block, nvme_path={str(tmp_path / "kv")!r},
                    nvme_bytes=16 << 20)
        ns = Namespace(model="m")
        toks = np.arange(4 * lay.tokens_per_block)
        kv = torch.randn(4, *lay.block_shape).to(lay.dtype)
        stored = [x.value for x in s.store(ns, toks, kv)]
        st, out = s.load(s.lookup(ns, toks))
        exact = leading_ok(st) == 4 and all(torch.equal(a, b) for a, b in zip(out, kv))
        s.close()
        for m in {mods!r}:
            importlib.import_module(m)
        loaded = [m for m in {OPTIONAL!r} if m in sys.modules]
        try:
            import tierstore.client
            client = "imported"
        except tierstore.errors.ConfigError as e:
            client = str(e)
        print(json.dumps({{"stored": stored, "exact": exact, "loaded": loaded, "client": client,
                          "file": tierstore.__file__}}))
    """)
    p = _run([str(core_venv / "bin" / "python"), "-c", script], cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert str(core_venv) in got["file"]  # the installed wheel, not this checkout
    assert got["stored"] == ["ok"] * 4 and got["exact"] is True
    assert got["loaded"] == []
    assert "pip install 'tierstore[server]'" in got["client"]
    # the README's first command, on the core install (status lines instead of rich's bar)
    p = _run([str(core_venv / "bin" / "tierstore"), "bench", "--rw=kvtrace"], cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "lookup_hit_ratio" in p.stdout and "wrong_kv_blocks" in p.stdout
    # what needs an extra says which
    p = _run([str(core_venv / "bin" / "tierstore"), "serve", "--config", "x.yaml"], cwd=str(tmp_path))
    assert p.returncode == 1 and "pip install 'tierstore[server]'" in p.stderr
    p = _run(
        [str(core_venv / "bin" / "tierstore"), "bench", "--rw=kvtrace", "--plot=plots"], cwd=str(tmp_path)
    )
    assert "pip install 'tierstore[bench]'" in p.stderr, p.stderr[-2000:]


def test_every_optional_import_is_an_extra_of_pyproject():
    tomllib = pytest.importorskip("tomllib")

    from tierstore.extras import EXTRA_OF

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for mod, extra in EXTRA_OF.items():
        assert extra in extras, (mod, extra)
    deps = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    for name in ("matplotlib", "rich", "aiohttp", "prometheus", "sh>"):
        assert name not in deps
    assert {"server", "bench", "fdp", "cluster"} <= set(
        extras["test"][-1].split("[")[1].rstrip("]").split(",")
    )
