"""Parameter-server training: the strategy, its worker-side client and its server-side shards."""
