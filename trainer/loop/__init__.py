"""The fit, evaluation and predict loops and what one step needs: counters, hook dispatch, RNG, the loss check
and signals."""
