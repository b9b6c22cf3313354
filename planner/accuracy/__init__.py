"""How far to trust a prediction: the measured error of the benches that cover it (planner.accuracy.bands)."""
