"""Live recovery on torchft: replica groups that keep training when one of them dies, and heal a restarted one from
a live peer (docs/fault-tolerance.md#live-recovery-torchft). strategy.py is the strategy, slices.py deals each
step's global batch over the replicas of its quorum, lighthouse.py starts and checks torchft's lighthouse."""
