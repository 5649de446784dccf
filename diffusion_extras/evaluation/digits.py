"""The digit classifier that scores generated digits (the benchmarks' and an inpainting model's
class accuracy): logistic regression on scikit-learn's 8x8 digits, every image taken through the
trainer's preprocessing (data/images.py digits_dataset, at the model's resolution) and shrunk back
to 8x8. An image set made of such digits (the held-out digits of a run, a folder of them) is
recognised by its exact pixels: their labels are those digits', and the classifier is fitted on
the other digits only, so it never saw the images it judges."""
from __future__ import annotations

import numpy as np

from diffusion_extras.data.spec import Resolution


def classifier_input(images: np.ndarray) -> np.ndarray:
    """images uint8 [N, H, W, 1] at the model's resolution -> [N, 64] at the 8x8 0..1 scale the
    classifier knows."""
    from PIL import Image

    small = np.stack([np.asarray(Image.fromarray(im[:, :, 0]).resize((8, 8), Image.BILINEAR), np.float64)
                      for im in images]) / 255.0
    return small.reshape(len(small), -1)


def preprocessed_digits(resolution: Resolution) -> tuple[np.ndarray, np.ndarray]:
    """(scikit-learn's 1,797 digits as a training run at `resolution` holds them, uint8 [N, H, W, 1];
    their labels)."""
    from diffusion_extras.data import decode_cache
    from diffusion_extras.data.images import digits_dataset

    dataset = digits_dataset()
    images = decode_cache.decode_dataset(dataset, "image", resolution, True, 1)
    return np.stack([images.image(i) for i in range(len(images))]), np.asarray(dataset["label"])


class DigitClassifier:
    """A logistic regression on classifier_input features."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        from sklearn.linear_model import LogisticRegression

        self.model = LogisticRegression(max_iter=2000).fit(classifier_input(images), labels)
        self.trained_on = len(images)

    def predict(self, images: np.ndarray) -> np.ndarray:
        return self.model.predict(classifier_input(images))

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        return float((self.predict(images) == labels).mean())


def recognised(images: np.ndarray) -> tuple[np.ndarray, DigitClassifier] | None:
    """(the labels of `images`, uint8 [N, H, W, 1], a classifier fitted on the digits not among them)
    when every image is one of scikit-learn's digits at that resolution; else None (not digits)."""
    if images.ndim != 4 or images.shape[-1] != 1:
        return None
    digits, labels = preprocessed_digits(tuple(images.shape[1:3]))
    by_pixels = {digit.tobytes(): label for digit, label in zip(digits, labels)}
    found = [by_pixels.get(image.tobytes()) for image in images]
    if any(label is None for label in found):
        return None
    judged = {image.tobytes() for image in images}
    others = np.array([digit.tobytes() not in judged for digit in digits])
    return np.asarray(found), DigitClassifier(digits[others], labels[others])
