"""`python -m trainer ...` is the `trainer` command."""

from trainer.cli import main

raise SystemExit(main())
