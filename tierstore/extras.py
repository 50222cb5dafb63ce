"""Optional dependencies and the pip extras that bring them.

The core install (``pip install tierstore``: what an engine imports, ``KVStore``,
the connectors, the trace replay) needs none of these; each feature that does
imports its package when it runs, through :func:`require`, so a missing one is
a one-line error naming the extra to install.

========== ======================= ==============================================
extra       packages                what needs them
========== ======================= ==============================================
``server``  aiohttp,                the daemon (``tierstore serve``) and its client
            prometheus-client       (:class:`tierstore.client.RemoteKVStore`)
``bench``   rich, matplotlib,       ``tierstore bench``'s progress bar (status lines
            fio-plot                without it), ``--plot`` charts; fio-plot reads
                                    the JSON (tests)
``fdp``     sh                      nvme-cli for FDP discovery and log pages
``cluster`` mooncake-transfer-      the shared remote tier (:mod:`tierstore.remote`)
            engine-non-cuda
``vllm``    vllm                    :mod:`tierstore.integrations.vllm`
``sglang``  sglang                  :mod:`tierstore.integrations.sglang`
``node``    msgspec                 the node service's control protocol
                                    (:mod:`tierstore.node.protocol`)
========== ======================= ==============================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ConfigError

#: top-level module -> the extra that installs it
EXTRA_OF = {
    "aiohttp": "server",
    "prometheus_client": "server",
    "rich": "bench",
    "matplotlib": "bench",
    "fio_plot": "bench",
    "sh": "fdp",
    "mooncake": "cluster",
    "vllm": "vllm",
    "sglang": "sglang",
    "msgspec": "node",
}


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` for ``what``.

    Raises
    ------
    ConfigError
        When it is not installed: ``"<what> needs <module>, which is not installed: pip install
        'tierstore[<extra>]' (from a source checkout: pip install -e '.[<extra>]')"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra = EXTRA_OF.get(top)
        how = (
            f"pip install 'tierstore[{extra}]' (from a source checkout: pip install -e '.[{extra}]')"
            if extra
            else f"pip install {top}"
        )
        raise ConfigError(f"{what} needs {top}, which is not installed: {how}") from e


def available(module: str) -> bool:
    """Whether ``module`` can be imported (it is, if so)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
