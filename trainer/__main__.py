"""`python -m torchyard.trainer ...` is the `trainer` command."""

from torchyard.trainer.cli.main import main

# Under the guard: the processes the Trainer starts re-import this module as their __main__.
if __name__ == "__main__":
    raise SystemExit(main())
