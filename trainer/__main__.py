"""`python -m torchyard.trainer ...` is the `trainer` command."""

from torchyard.trainer.cli import main

raise SystemExit(main())
