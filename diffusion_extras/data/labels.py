"""Class labels (--class_conditional): which column holds them, the classes they declare, and each
image's class id: for cached data one array read once, for a stream read from each example as it
is decoded (so the label travels with its image through the stream's shuffle, shards, workers and
saved position).

The label column is --label_column, else the dataset's one ClassLabel column (an imagefolder's
subfolder names, the digits' `label`), else, as webdataset tar shards keep it, the sample's `cls`
entry or the `label` field of its `json` entry (`--label_column json.label` names a field of a
struct column explicitly).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from diffusion_extras.data.images import DataError

WEBDATASET_LABELS = ("cls", "json.label")  # a tar shard sample's class, in order of preference


@dataclass(frozen=True)
class Classes:
    """The classes of a run's data: names by class id, the column the labels are read from, and for
    cached data the class id of every dataset row."""
    names: list[str]
    column: str                           # 'json.label': the field `label` of the struct column `json`
    by_name: bool = False                 # the column holds class names (their ids: sorted order)
    row_labels: np.ndarray | None = None  # int64 per dataset row; None for a stream (read per example)

    def reader(self) -> LabelReader:
        return LabelReader(self.column, self.names, self.by_name)


class LabelReader:
    """The class id of one streamed example, checked against the classes read before training.
    Plain data, so DataLoader workers can unpickle it."""

    def __init__(self, column: str, names: list[str], by_name: bool):
        self.column, self.path, self.num_classes = column, column.split("."), len(names)
        self.index = {name: i for i, name in enumerate(names)} if by_name else None

    def __call__(self, example: dict) -> int:
        value = field_value(example, self.path)
        if self.index is not None:
            if value not in self.index:
                raise DataError(f"--label_column {self.column}: class {value!r} is not among the "
                                f"{self.num_classes} read before training; has the data changed?")
            return self.index[value]
        if not _is_int(value) or not 0 <= value < self.num_classes:
            raise DataError(f"--label_column {self.column}: label {value!r} is outside the declared classes "
                            f"0..{self.num_classes - 1}")
        return int(value)


def field_value(example: dict, path: list[str]):
    for part in path:
        example = example[part]
    return example


def label_feature(features, column: str):
    """The feature at `column` (a column, or 'struct.field'), or None when there is none."""
    feature = features
    for part in column.split("."):
        if not isinstance(feature, dict) or part not in feature:  # Features and struct features are dicts
            return None
        feature = feature[part]
    return feature


def find_label_column(features, label_column: str | None = None) -> str:
    """--label_column (checked to exist), or the one ClassLabel column, or a webdataset label."""
    import datasets

    columns = ", ".join(features)
    if label_column is not None:
        if label_feature(features, label_column) is None:
            raise DataError(f"--label_column {label_column} is not in the dataset (columns: {columns})")
        return label_column
    found = [column for column, feature in features.items() if isinstance(feature, datasets.ClassLabel)]
    if not found:
        found = [column for column in WEBDATASET_LABELS if label_feature(features, column) is not None][:1]
    if len(found) != 1:
        what = "no ClassLabel column" if not found else f"several ClassLabel columns ({', '.join(found)})"
        raise DataError(f"--class_conditional: the dataset has {what} (columns: {columns}) and no webdataset "
                        "`cls` or `json` label; pass --label_column NAME for the column of class ids or names")
    return found[0]


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def classes_from_values(values: list, feature, label_column: str) -> tuple[np.ndarray, list[str], bool]:
    """(int64 class id per value, class names by id, whether the values are names). A ClassLabel
    declares its classes; other labels must be non-negative ints (classes 0..max) or names (classes
    sorted by name). A class with no images is a warning."""
    import datasets

    by_name = False
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
    elif values and all(_is_int(v) for v in values):
        names = [str(i) for i in range(max(values) + 1)]
    elif values and all(isinstance(v, str) for v in values):
        names, by_name = sorted(set(values)), True
        index = {name: i for i, name in enumerate(names)}
        values = [index[v] for v in values]
    else:
        bad = next((v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool)), values[:1])
        raise DataError(f"--label_column {label_column}: labels must be ints or class names (got {bad!r})")
    labels = np.asarray(values, dtype=np.int64)
    outside = labels[(labels < 0) | (labels >= len(names))]
    if len(outside):
        raise DataError(f"--label_column {label_column}: label {int(outside[0])} is outside the declared "
                        f"classes 0..{len(names) - 1} ({len(outside)} row(s))")
    empty = [names[i] for i in np.flatnonzero(np.bincount(labels, minlength=len(names)) == 0)]
    if empty:
        warnings.warn(f"--label_column {label_column}: class(es) with no images: {', '.join(empty)}", stacklevel=2)
    return labels, names, by_name


def read_classes(dataset, label_column: str | None) -> Classes:
    """The classes of a cached dataset (datasets.Dataset) and every row's class id, read once."""
    import pyarrow.compute as pc

    column = find_label_column(dataset.features, label_column)
    top, *fields = column.split(".")
    array = dataset.with_format("arrow")[:].column(top)
    for field in fields:
        array = pc.struct_field(array, field)
    labels, names, by_name = classes_from_values(array.to_pylist(), label_feature(dataset.features, column), column)
    return Classes(names, column, by_name, labels)


def class_labels(dataset, label_column: str | None) -> tuple[np.ndarray, list[str]]:
    """(int64 class id per row, class names by id) of a datasets.Dataset."""
    classes = read_classes(dataset, label_column)
    return classes.row_labels, classes.names


def stream_classes(stream, label_column: str | None) -> Classes:
    """The classes of a stream (datasets.IterableDataset). A ClassLabel column declares them and
    nothing is read; any other label column is read once before training, labels only (no image
    is decoded, but a tar shard is read whole): declare a ClassLabel feature to skip that pass."""
    import datasets

    column = find_label_column(stream.features, label_column)
    feature = label_feature(stream.features, column)
    if isinstance(feature, datasets.ClassLabel):
        return Classes(list(feature.names), column)
    path = column.split(".")
    values = [field_value(example, path) for example in stream.select_columns([path[0]])]
    _, names, by_name = classes_from_values(values, feature, column)
    return Classes(names, column, by_name)
