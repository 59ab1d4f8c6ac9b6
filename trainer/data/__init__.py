"""Loaders as a strategy needs them: sharded and resumable samplers, several loaders read as one, batch order and
device moves."""
