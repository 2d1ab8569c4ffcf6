"""charlm: a small byte-level GPT on Python standard-library source. See spec.py, then train.py."""
