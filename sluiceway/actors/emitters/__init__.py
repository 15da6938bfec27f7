"""Emitters: one per API surface, turning output events into wire bytes."""
