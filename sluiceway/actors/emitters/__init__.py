"""Emitters: one per API surface, turning output events into wire bytes
(sans-IO encoders for streams, accumulators for whole replies)."""
