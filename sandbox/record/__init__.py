"""Record: what a run's collected facts mean, written into its record.

The run's first record (`running`), its status and reason drawn from what the collect
phase gathered, and the final write that ends it.
"""
