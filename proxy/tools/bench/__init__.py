"""`tokenweir bench`, the load generator: its entry in run.py, the work in the sibling modules."""
