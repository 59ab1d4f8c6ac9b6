"""Starting a job's processes when no launcher did: the elastic-agent launch, unguarded scripts, warm workers,
Ray actors, ssh hosts and SLURM batch jobs."""
