"""Experiment drivers over the stages: they run the stages' command-line tools and their
evaluation code and write reports (docs/RESULTS.md). No stage imports this package."""
