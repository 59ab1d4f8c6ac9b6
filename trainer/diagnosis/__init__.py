"""Watching the ranks of a job: where each one is (markers), what a stuck job reports (watchdog) and the same report
of a running job on demand (doctor: `trainer doctor`), which rank is slower than the others (stragglers).
docs/diagnosis.md shows what each case prints."""
