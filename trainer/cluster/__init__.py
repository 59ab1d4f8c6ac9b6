"""This process's place in the job: its rank, local rank, world size and master from whatever launched it, the
checks every node runs before the nodes meet, and whether the script called us under its main guard."""
