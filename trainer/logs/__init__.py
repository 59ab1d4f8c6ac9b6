"""What a run records: `self.log` collection, the loggers that write it, run folders and their files (config.yaml,
the evaluator's record), and plots of finished runs."""
