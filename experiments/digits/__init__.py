"""digits: 8x8 handwritten digits read as PNG files from a volume. See spec.py, then train.py."""
