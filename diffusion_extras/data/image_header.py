"""What an image file holds, read from its header before Pillow decodes the pixels: whether it is
grayscale, and which decoded sample values are black and white.

Pillow's mode alone says neither. It opens a 16-bit PGM, a signed 16-bit TIFF, a 32-bit integer
TIFF and (before Pillow 10.3) a 16-bit grayscale PNG all as mode I (int32); a 12-bit TIFF as I;16
holding 0..4095; a 16-bit gray+alpha PNG as RGBA and a grey palette as P. What the file says
(the TIFF tags, the decoder's raw mode in Pillow's `tile`) is readable only until the pixels load
(load() empties `tile`), so read_header is asked first."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from PIL import Image

GRAYSCALE_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")  # PIL modes with one colour
# PIL modes that numpy reads at more than 8 bits: one channel, scaled by ImageHeader.black / white
DEEP_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")
INT32 = (-2 ** 31, 2 ** 31 - 1)
# mode I's sample range by the decoder's raw mode, where the format says no more (a 16-bit grayscale PNG
# before Pillow 10.3, Pillow's own IM files): unsigned and signed 16-bit, signed 32-bit. Unsigned 32-bit
# raw modes (I;32B: McIDAS, FITS) are left out: their formats use them for signed data too
RAW_MODE_RANGES = {**dict.fromkeys(("I;16", "I;16B", "I;16L", "I;16N"), (0, 65535)),
                   **dict.fromkeys(("I;16S", "I;16BS", "I;16LS", "I;16NS"), (-32768, 32767)),
                   **dict.fromkeys(("I;32S", "I;32BS", "I;32LS", "I;32NS"), INT32)}
TIFF_BITS_PER_SAMPLE, TIFF_SAMPLE_FORMAT = 258, 339  # SampleFormat: 1 unsigned, 2 signed, 3 float


class ImageHeader(NamedTuple):
    """One file's sample range and transparency key: what decoding it needs."""
    black: float | None = 0        # the decoded sample value of black, and of white: 0 and 255 for 8-bit modes,
    white: float | None = 255      # the file's bit depth and sign for I / I;16*, 0.0 and 1.0 for F; None: unknown
    raw_mode: str | None = None    # the decoder's raw mode (how the file lays out its samples), when Pillow says
    reduced: bool = False          # 16-bit samples that Pillow decodes to 8 bits (colour, or gray with alpha)
    transparency: object = None    # the transparency key (tRNS) in the decoded samples' units, or None


def read_header(image: Image.Image) -> ImageHeader:
    """The header of a freshly opened image. Once loaded (or if made in memory) it has no raw mode,
    and a mode I image's range is then known only from a TIFF's tags or a PGM."""
    raw_mode = _raw_mode(image)
    reduced = image.mode in ("RGB", "RGBA") and raw_mode is not None and raw_mode.endswith(";16B")
    black, white = _sample_range(image, raw_mode) if image.mode in DEEP_MODES else (0, 255)
    key = image.info.get("transparency")
    low_bits = {"L;2": 2, "L;4": 4}.get(raw_mode) if image.format == "PNG" else None
    if low_bits and isinstance(key, int):
        # Pillow scales a 2- or 4-bit grey PNG's samples to 8 bits but not its tRNS key, so the key
        # would match no pixel: scaled here as the samples are (x 85, x 17)
        key *= 255 // (2 ** low_bits - 1)
    return ImageHeader(black, white, raw_mode, reduced, key)


def holds_grayscale(image: Image.Image) -> bool:
    """Whether a freshly opened image holds one colour: a grayscale mode, a 16-bit gray+alpha PNG
    (Pillow: RGBA, from raw mode LA;16B) or a palette whose entries are all grey. It converts the
    palette (~0.1 ms), so only the channel detection asks it, not each decode."""
    raw_mode = _raw_mode(image)
    gray_with_alpha = image.mode == "RGBA" and raw_mode is not None and raw_mode.split(";")[0] == "LA"
    return image.mode in GRAYSCALE_MODES or gray_with_alpha or _grey_palette(image)


def _raw_mode(image: Image.Image) -> str | None:
    tile = getattr(image, "tile", None)  # an image made in memory has none
    if not tile:
        return None
    args = tile[0][-1]  # (decoder, extents, offset, args): a named tuple since Pillow 10.2, a tuple before
    if isinstance(args, tuple):
        args = args[0] if args else None
    return args if isinstance(args, str) else None


def _sample_range(image: Image.Image, raw_mode: str | None) -> tuple:
    """(black, white) of a deep image as the file states them, (None, None) where it does not."""
    if image.mode == "F":
        return 0.0, 1.0  # float images: 0 black, 1 white (a file outside [0, 1] is refused when decoded)
    if image.format == "TIFF":
        bits = _first(image.tag_v2.get(TIFF_BITS_PER_SAMPLE, 1))
        signed = _first(image.tag_v2.get(TIFF_SAMPLE_FORMAT, 1)) == 2
        return (-2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    if image.format == "PPM" and image.mode == "I":
        return 0, 65535  # Pillow rescales any PGM maxval above 255 to 0..65535
    if image.mode != "I":
        return 0, 65535  # I;16 and its byte orders
    return RAW_MODE_RANGES.get(raw_mode, (None, None))


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _grey_palette(image: Image.Image) -> bool:
    """Whether every entry of a P image's palette is grey (R = G = B), read through Pillow's own
    palette conversion (the palette's raw mode may be RGB, BGR, BGRX ...)."""
    if image.mode != "P" or image.palette is None:
        return False
    swatch = Image.frombytes("P", (256, 1), bytes(range(256)))  # one pixel per palette entry
    raw_mode, entries = image.palette.getdata()
    swatch.putpalette(entries, raw_mode)
    rgb = np.asarray(swatch.convert("RGB"))
    return bool((rgb == rgb[..., :1]).all())
