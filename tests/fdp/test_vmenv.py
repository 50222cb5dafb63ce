"""tests/fdp/vmenv.py: the guest image holds every package the guest's phases import."""

from __future__ import annotations

from tests.fdp import vmenv


def test_the_guest_image_packs_the_extras_the_guest_phases_import():
    """The daemon phase imports prometheus_client and aiohttp ([server]); once they moved from
    the core requirements to the extra, the guest's daemon died at start-up (CI's fdp session)."""
    tops = vmenv._dependency_tops()
    assert {"aiohttp", "prometheus_client", "rich", "torch", "numpy", "pydantic"} <= tops
