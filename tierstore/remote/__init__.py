"""The shared remote tier (scale-out on Mooncake Store).

Importing this package never imports Mooncake: :class:`MooncakeTier` loads it
when a tier is built, and raises :class:`tierstore.errors.ConfigError` naming
the ``tierstore[cluster]`` extra when it is not installed.
"""

from .admission import ShareAdmission
from .format import ObjectNamer
from .mooncake import MooncakeTier, RegisteredRegion, load_mooncake_store
from .settings import MooncakeTuning, RemoteConfig, parse_remote_options

__all__ = [
    "MooncakeTier",
    "MooncakeTuning",
    "ObjectNamer",
    "RegisteredRegion",
    "RemoteConfig",
    "ShareAdmission",
    "load_mooncake_store",
    "parse_remote_options",
]
