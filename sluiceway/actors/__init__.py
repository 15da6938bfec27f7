"""Thin async shells, one per module, that pass typed messages over channels."""
