"""torch.compile as a Trainer option: the options (options.py), applying them to a module's regions after the strategy
wrapped it (regions.py), and the record of what compiling cost and where graphs broke (report.py)."""
