"""Build the digits volume: scikit-learn's bundled 8x8 handwritten digits, one grayscale PNG per image.

No network: `sklearn.datasets.load_digits` ships inside scikit-learn. The 1,797 images (pixel values 0-16)
are scaled to 0-255 and written as files whose name carries the label for people, and whose PNG text chunk
`label` carries it for the training job (it reads a cached copy whose name is a hash). A seeded,
stratified split gives 1,077 train, 360 validation and 360 test images, every class in each. The validation
images are the same 360 as in version 2 (which had no test split); the test images are carved out of its
1,437 training images. Only the end of a run scores the test split (`test_accuracy`): no search decision reads it.

    $AUTORESEARCH_HOME/volumes/digits/train/d0007-label3.png ... val/... test/... MANIFEST.json

Runs by itself the first time a trial needs the data (`ensure()`), safely when several jobs start at once.
By hand: `python -m experiments.digits.prepare [--out DIR]`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from experiments.common import prepare_once

NAME = "digits"
VERSION = 3  # bump when the layout changes: old volumes are rebuilt
VAL_FRACTION = 0.2
TEST_IMAGES = 360  # carved out of the training images, stratified
SPLIT_SEED = 0
LABEL = re.compile(r"label(\d)\.png$")


def label_of(path: str | Path) -> int:
    """The class of an image file, read from its name (`...-label7.png` -> 7)."""
    match = LABEL.search(str(path))
    if match is None:
        raise ValueError(f"not a digits image name: {path}")
    return int(match.group(1))


def build(out: Path) -> dict:
    """Write train/, val/ and test/ PNG files into the empty directory `out`; return facts for the manifest."""
    import numpy as np
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
    index = np.arange(len(images))
    train_idx, val_idx = train_test_split(index, test_size=VAL_FRACTION, random_state=SPLIT_SEED,
                                          stratify=digits.target)
    train_idx, test_idx = train_test_split(train_idx, test_size=TEST_IMAGES, random_state=SPLIT_SEED,
                                           stratify=digits.target[train_idx])
    for split, ids in (("train", train_idx), ("val", val_idx), ("test", test_idx)):
        (out / split).mkdir()
        for i in sorted(ids):
            info = PngInfo()
            info.add_text("label", str(digits.target[i]))
            name = f"d{i:04d}-label{digits.target[i]}.png"
            Image.fromarray(images[i]).save(out / split / name, pnginfo=info)
    return {"train_images": int(len(train_idx)), "val_images": int(len(val_idx)),
            "test_images": int(len(test_idx)), "size": [8, 8],
            "classes": 10}


def ensure(target: Path | None = None) -> Path:
    """The volume directory, built on first use (idempotent; concurrent callers wait for one builder)."""
    return prepare_once(NAME, VERSION, build, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="volume directory (default: under the home)")
    print(ensure(parser.parse_args(argv).out))


if __name__ == "__main__":
    main()
