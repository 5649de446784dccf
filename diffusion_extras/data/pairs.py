"""Image files and their partners: which files of a folder are images (one list of extensions for
the trainer's --train_data_dir, the paired folders and the commands' folders), and a folder paired
file by file with --train_data_dir (--conditioning_data_dir, --mask_data_dir) as a dataset of two
image columns. Below images.py (which opens a paired folder as the training split) and
conditioning.py (which decodes each pair): it imports neither.
"""
from __future__ import annotations

import functools
import os

from diffusion_extras.data.spec import DataError, DataSpec

CONDITIONING_IMAGE_COLUMN = "conditioning_image"  # a paired folder's conditioning images, as a column
MASK_COLUMN = "mask"                              # a paired folder's masks, as a column


@functools.cache
def image_extensions() -> tuple[str, ...]:
    """The extensions (lower case, with the dot) of the files read as images: those of datasets'
    `imagefolder` builder, which reads --train_data_dir, so that a folder the trainer reads, a
    paired folder and a command's folder take the same files. Imported when asked: datasets is slow
    to import and the config's validation, which imports the data layer, runs without it."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    return tuple(sorted(ImageFolder.EXTENSIONS))


def is_image_file(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in image_extensions()


def image_files(folder: str, flag: str) -> dict[str, str]:
    """{relative path without extension: path} of the image files under `folder` (image_extensions,
    any case). Two files of one stem (`3.png` and `3.jpg`) would both be the partner of image `3`:
    refused, naming both and `flag` (the folder's option)."""
    extensions, found = image_extensions(), {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            stem, extension = os.path.splitext(name)
            if extension.lower() not in extensions:
                continue
            key, path = os.path.relpath(os.path.join(root, stem), folder), os.path.join(root, name)
            if key in found:
                raise DataError(f"{flag} {folder}: {found[key]} and {path} have one name but for the extension, and "
                                "a file is paired by its name: keep one of them")
            found[key] = path
    return found


def paired_folder(spec: DataSpec) -> tuple[str, str, str] | None:
    """(the folder paired with --train_data_dir, the column its files become, its flag), or None."""
    if spec.train_data_dir and spec.conditioning_data_dir:
        return spec.conditioning_data_dir, CONDITIONING_IMAGE_COLUMN, "--conditioning_data_dir"
    if spec.train_data_dir and spec.mask_data_dir:
        return spec.mask_data_dir, MASK_COLUMN, "--mask_data_dir"
    return None


def paired_folders_dataset(image_folder: str, condition_folder: str, column: str, flag: str):
    """A datasets.Dataset of two image columns, `image` and `column`: each image of `image_folder`
    with the one file of `condition_folder` (given by `flag`) at the same relative path, of any
    image extension, in path order. An image without its partner, or with two, is refused, naming
    it. In memory: listed at each start (a dataset with the two columns is cached once)."""
    import datasets

    images, conditions = image_files(image_folder, "--train_data_dir"), image_files(condition_folder, flag)
    if not images:
        raise DataError(f"--train_data_dir {image_folder}: no images found")
    unpaired = sorted(set(images) - set(conditions))
    if unpaired:
        raise DataError(f"{len(unpaired)} image(s) of {image_folder} have no file at the same relative path in "
                        f"{condition_folder} (first: {images[unpaired[0]]}); give every image its pair")
    keys = sorted(images)
    features = datasets.Features({"image": datasets.Image(), column: datasets.Image()})
    return datasets.Dataset.from_dict({"image": [images[k] for k in keys], column: [conditions[k] for k in keys]},
                                      features=features)
