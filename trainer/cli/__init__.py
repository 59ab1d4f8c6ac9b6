"""The `trainer` command: subcommands, YAML recipes, their class checks, and the README's table of options."""
