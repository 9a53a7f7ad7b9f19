"""A comparison's figures (figures.py: SQL over the store), its page (page.py: docs/evidence.md) and its curves
(plots.py), and the arms it compares (arms.py). The compare flow is flows/compare.py."""
