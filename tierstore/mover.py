"""Compatibility: the movers are :mod:`tierstore.movers` (``Mover`` is :class:`~tierstore.movers.Movers`)."""
from .movers import LoadGate, Movers as Mover, make_movers

__all__ = ["LoadGate", "Mover", "make_movers"]
