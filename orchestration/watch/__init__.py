"""`eyas watch`: the served acceptance over time, read from the engine's spec-decode counters, and whether the
drafter is still current — its acceptance against the level measured at promotion, its target still the one it was
trained on."""
