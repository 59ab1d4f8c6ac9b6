"""Scaling studies: `trainer scale` runs a recipe at several layouts and reports which is fastest."""
