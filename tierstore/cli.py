"""The ``tierstore`` command.

``tierstore bench [JOBFILE ...] [--key=value ...]``  fio-style benchmark (see ``tierstore bench --help``).
``tierstore serve --config FILE``                    the storage daemon.
``tierstore serve --node --config FILE``             the node service (UNIX socket, shared memory).
``tierstore fdp discover|stats DEVICE``              an FDP namespace: configuration, PIDs per class, WAF.
``tierstore version``, ``tierstore --version``       print the version (from the package metadata).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch a subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    if cmd == "serve":
        from .errors import ConfigError
        from .extras import require

        try:
            for mod in ("aiohttp", "prometheus_client"):
                require(mod, "the daemon")
            from .server.daemon import main as serve_main
        except ConfigError as e:
            print(f"tierstore serve: {e}", file=sys.stderr)
            return 1
        except ImportError as e:
            print(f"tierstore serve: the daemon is not available: {e}", file=sys.stderr)
            return 1
        return serve_main(rest)
    if cmd == "fdp":
        from .fdp.admin import main as fdp_main

        return fdp_main(rest)
    if cmd in ("version", "--version", "-V"):
        print(f"tierstore {_version()}")
        return 0
    print(
        f"tierstore: unknown command {cmd!r}; commands: bench, serve, fdp, version (or --version)",
        file=sys.stderr,
    )
    return 2


def _version() -> str:
    """The installed distribution's version (package metadata), else the source tree's ``__version__``."""
    import importlib.metadata

    try:
        return importlib.metadata.version("tierstore")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        from . import __version__

        return __version__


def _entry() -> int:
    """Console-script entry: Ctrl-C and a closed pipe end with a status, not a traceback.

    Ctrl-C ends with one line and status 130. A reader that closes stdout early
    (``tierstore bench --help | head``) ends the command quietly with status 141, as a shell
    reports a process killed by SIGPIPE (128 + 13); stdout is pointed at ``/dev/null`` first so
    that the interpreter's final flush does not raise again (the recipe of Python's ``signal``
    documentation, "Note on SIGPIPE").
    """
    try:
        status = main()
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        print("tierstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(_entry())
