"""tabular: regression on a synthetic table of known generative process, read as Parquet exported from Delta."""
