"""Images as stored (data/images.py, data/image_header.py): 16- and 32-bit samples keep their
precision into the [-1, 1] tensor, scaled from the range the file states; transparency (alpha or a
tRNS key) is composited on --background or kept (--keep_alpha); EXIF orientation is applied;
palette / CMYK / LA convert as Pillow defines them; grayscale is what the file holds, whatever
Pillow's mode. Each case is a real file, written by Pillow or, where Pillow cannot write it, chunk
by chunk (PNG) or tag by tag (TIFF), compared with the training tensor."""
import struct
import zlib
from contextlib import nullcontext

import datasets
import numpy as np
import pytest
import torch
from helpers import run_training
from PIL import Image

from diffusion_extras.data import batch_order, decode_cache, sources
from diffusion_extras.data import images as data
from diffusion_extras.data.spec import DataSpec


class OneProcess:
    process_index, num_processes, is_local_main_process = 0, 1, True
    device = torch.device("cpu")

    def local_main_process_first(self):
        import contextlib
        return contextlib.nullcontext()


SIXTEEN_BIT = np.array([[0, 1000, 30000, 65535]] * 4, dtype=np.uint16)  # black, white and two levels between


def training_tensor(folder, channels=None, streaming=False, **spec) -> torch.Tensor:
    """The first micro-batch as the model sees it, through the real data path (open_training_data,
    build_source, to_model_input), for a folder of images at their own size (no resize)."""
    spec = DataSpec(train_data_dir=str(folder), resolution=4, train_batch_size=1, streaming=streaming,
                    shuffle_buffer_size=0, cache_dir=str(folder) + "-cache", **spec)
    dataset, found, _ = sources.open_training_data(spec, OneProcess())
    source = sources.build_source(spec, OneProcess(), channels or found, dataset)
    batch = next(iter(source.batches(0, 1)))
    return batch_order.to_model_input(batch, "cpu")[0]


def png_bytes(samples: np.ndarray, colour_type: int, chunks: bytes = b"", depth: int = 16) -> bytes:
    """A PNG written chunk by chunk, for what Pillow cannot write (16-bit colour, 16-bit gray+alpha,
    a 2-bit grey image with a key): samples [H, W, C] at `depth` bits, colour type 0 gray, 2 RGB, 4 gray+alpha."""
    height, width = samples.shape[:2]
    if depth == 16:
        packed = samples.astype(">u2").reshape(height, -1).view(np.uint8)
    else:  # `depth` bits a sample, most significant first
        bits = np.unpackbits(samples.astype(np.uint8).reshape(height, -1, 1), axis=-1)[..., 8 - depth:]
        packed = np.packbits(bits.reshape(height, -1), axis=-1)
    rows = b"".join(b"\x00" + row.tobytes() for row in packed)  # filter type 0 per row
    header = struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + chunks + png_chunk(b"IDAT", zlib.compress(rows))
            + png_chunk(b"IEND", b""))


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def tiff_bytes(samples: np.ndarray, bits: int, sample_format: int, strip: bytes | None = None) -> bytes:
    """A one-strip grayscale little-endian TIFF written tag by tag, for what Pillow cannot write
    (signed 16-bit, 12-bit, unsigned 32-bit); `strip` gives packed samples (12-bit) as stored."""
    height, width = samples.shape
    strip = samples.astype(samples.dtype.newbyteorder("<")).tobytes() if strip is None else strip
    tags = [(256, width), (257, height), (258, bits), (259, 1), (262, 1), (273, 8), (277, 1), (278, height),
            (279, len(strip)), (339, sample_format)]  # 262 BlackIsZero, 273 the strip right after the header
    entries = b"".join(struct.pack("<HHII", tag, 4, 1, value) for tag, value in tags)  # all as LONG
    return b"II*\x00" + struct.pack("<I", 8 + len(strip)) + strip + struct.pack("<H", len(tags)) + entries + b"\0" * 4


def one_image_folder(tmp_path, image: Image.Image, name="a.png", **save) -> str:
    folder = tmp_path / "images"
    folder.mkdir()
    image.save(folder / name, **save)
    return folder


@pytest.mark.parametrize("streaming", [False, True])
def test_a_16_bit_png_trains_its_16_bit_values(tmp_path, streaming):
    folder = one_image_folder(tmp_path, Image.fromarray(SIXTEEN_BIT))
    assert Image.open(folder / "a.png").mode in ("I;16", "I")  # what Pillow hands over (I before Pillow 10.3)
    tensor = training_tensor(folder, streaming=streaming)
    expected = torch.from_numpy(SIXTEEN_BIT.astype(np.float32) / 32767.5 - 1)
    assert tensor.shape == (1, 4, 4)
    assert torch.allclose(tensor[0], expected, atol=1e-6)  # 1000 stays 1000/65535, not 255/255
    assert len(torch.unique(tensor)) == 4


def test_16_bit_precision_survives_a_resize_and_the_cache(tmp_path):
    ramp = (np.arange(64, dtype=np.float64).reshape(8, 8) * 7 + 20000).astype(np.uint16)  # steps of 7/65535
    folder = one_image_folder(tmp_path, Image.fromarray(ramp))
    spec = DataSpec(train_data_dir=str(folder), resolution=4, train_batch_size=1, cache_dir=str(tmp_path / "c"))
    dataset, channels, _ = sources.open_training_data(spec, OneProcess())
    source = sources.build_source(spec, OneProcess(), channels, dataset)
    images = source.images
    assert images.dtype == np.uint16
    # far finer than 8 bits could say: the 16 samples take 16 distinct values 2x2-averaged from the ramp
    values = images.image(0)[:, :, 0].astype(np.int64)
    assert len(np.unique(values)) == 16 and values.max() - values.min() < 65535 // 255 * 2
    again = sources.build_source(spec, OneProcess(), channels, dataset).images  # from the cache file
    assert isinstance(again.pixels, np.memmap) and np.array_equal(again.image(0), images.image(0))


def test_32_bit_integer_and_float_images_follow_the_stated_rules(tmp_path):
    integers = np.array([[-2 ** 31, 0, 2 ** 30, 2 ** 31 - 1]] * 4, dtype=np.int32)
    folder = one_image_folder(tmp_path, Image.fromarray(integers), "i.tiff")
    assert Image.open(folder / "i.tiff").mode == "I"
    expected = (integers.astype(np.float64) + 2 ** 31) / (2 ** 32 - 1) * 2 - 1  # the int32 range to [-1, 1]
    assert torch.allclose(training_tensor(folder)[0].double(), torch.from_numpy(expected), atol=1e-6)

    floats = np.array([[0.0, 0.25, 0.123456, 1.0]] * 4, dtype=np.float32)
    folder = tmp_path / "floats"
    folder.mkdir()
    Image.fromarray(floats).save(folder / "f.tiff")
    assert Image.open(folder / "f.tiff").mode == "F"
    assert torch.allclose(training_tensor(folder)[0], torch.from_numpy(floats * 2 - 1), atol=1e-6)  # 0 black, 1 white


def unit_values(tensor: torch.Tensor) -> np.ndarray:
    """A training tensor [C, H, W] in [-1, 1] back to [H, W, C] in [0, 1]."""
    return ((tensor.permute(1, 2, 0).double() + 1) / 2).numpy()


PGM_VALUES = np.array([[0, 1, 512, 1023]] * 4)


@pytest.mark.parametrize("header, body, maxval", [
    pytest.param(b"P5 4 4 65535\n", SIXTEEN_BIT.astype(">u2").tobytes(), 65535, id="raw-16-bit"),  # read as I;16B
    pytest.param(b"P5 4 4 1023\n", PGM_VALUES.astype(">u2").tobytes(), 1023, id="raw-10-bit"),  # Pillow rescales
    pytest.param(b"P2 4 4 1023\n", " ".join(map(str, PGM_VALUES.flat)).encode(), 1023, id="plain-10-bit")])
def test_a_16_bit_pgm_trains_its_values_not_the_int32_range(tmp_path, header, body, maxval):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.pgm").write_bytes(header + body)
    assert Image.open(folder / "a.pgm").mode == "I"  # Pillow's 32-bit integers, holding 16-bit values
    values = SIXTEEN_BIT if maxval == 65535 else PGM_VALUES
    got = unit_values(training_tensor(folder))[..., 0]
    assert np.abs(got - values / maxval).max() < 1e-5  # 1 of 1023 is 1/1023, not 0.5000000002


def test_a_16_bit_png_read_as_mode_i_trains_its_values(tmp_path, monkeypatch):
    """Pillow before 10.3 (which pyproject allows) opens a 16-bit grayscale PNG as mode I: its own
    table entry from then, set here, reproduces it on the pinned Pillow."""
    from PIL import PngImagePlugin
    monkeypatch.setitem(PngImagePlugin._MODES, (16, 0), ("I", "I;16B"))
    folder = one_image_folder(tmp_path, Image.fromarray(SIXTEEN_BIT))
    assert Image.open(folder / "a.png").mode == "I"
    assert np.abs(unit_values(training_tensor(folder))[..., 0] - SIXTEEN_BIT / 65535).max() < 1e-6


@pytest.mark.parametrize("name, samples, bits, sample_format, strip, black, white", [
    pytest.param("signed16", np.array([[-32768, -1, 0, 32767]] * 4, np.int16), 16, 2, None, -32768, 32767,
                 id="signed-16-bit"),  # Pillow: mode I, raw mode I;16S
    pytest.param("unsigned32", np.array([[0, 1, 2 ** 31, 2 ** 32 - 1]] * 4, np.uint32), 32, 1, None, 0, 2 ** 32 - 1,
                 id="unsigned-32-bit"),  # Pillow: mode I holding the bits as int32
    pytest.param("twelve", np.array([[0, 1, 2048, 4095]] * 4), 12, 1, b"\x00\x00\x01\x80\x0f\xff" * 4, 0, 4095,
                 id="12-bit")])  # Pillow: mode I;16 holding 0..4095; two samples in three bytes
def test_a_tiff_trains_by_its_bit_depth_and_sign(tmp_path, name, samples, bits, sample_format, strip, black, white):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / f"{name}.tiff").write_bytes(tiff_bytes(samples, bits, sample_format, strip))
    with Image.open(folder / f"{name}.tiff") as image:
        assert np.array_equal(np.asarray(image).astype(np.int64) % 2 ** 32, samples.astype(np.int64) % 2 ** 32)
    got = unit_values(training_tensor(folder))[..., 0]
    assert np.abs(got - (samples.astype(np.float64) - black) / (white - black)).max() < 2e-5


def mcidas_area() -> bytes:
    """A McIDAS area file of 4x4 4-byte elements: Pillow's mode I, raw mode I;32B, no word of black or white."""
    words = np.zeros(64, ">i4")
    words[[1, 8, 9, 10, 13, 33]] = 4, 4, 4, 4, 1, 256  # type, lines, elements, bytes each, bands, data offset
    return words.tobytes() + np.arange(16, dtype=">i4").tobytes()


def test_a_mode_i_image_whose_range_is_unknown_is_refused(tmp_path):
    path = tmp_path / "area"
    path.write_bytes(mcidas_area())
    assert Image.open(path).mode == "I"
    with pytest.raises(data.DataError, match=r"^\S*area: Pillow reads it as 32-bit integers \(mode I, raw mode "
                                             r"I;32B\) and nothing says.*save it as a 16-bit PNG or TIFF"):
        data.stored_format([{"path": str(path), "bytes": None}])
    with pytest.raises(data.DataError, match=r"\(mode I, no file behind it\)"):  # made in memory
        data.preprocess_image(Image.fromarray(np.zeros((4, 4), np.int32)), 4, False, 1)
    # the run's data source refuses it as it is built, before any step (main prints DataError's one line)
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"image": [{"bytes": mcidas_area(), "path": None}] * 2},
                               features=datasets.Features({"image": datasets.Image()})).save_to_disk(saved)
    spec = DataSpec(dataset_name=saved, resolution=4, train_batch_size=1, cache_dir=str(tmp_path / "cache"))
    dataset, channels, _ = sources.open_training_data(spec, OneProcess())
    with pytest.raises(data.DataError, match=r"^image 0: Pillow reads it as 32-bit integers \(mode I, raw mode I;32B"):
        sources.build_source(spec, OneProcess(), channels, dataset)


def test_a_float_image_outside_0_1_is_named_not_clipped(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.full((4, 4), 0.5, np.float32)).save(folder / "good.tiff")
    Image.fromarray(np.full((4, 4), 300.0, np.float32)).save(folder / "hdr.tiff")
    dataset = data.load_image_dataset(DataSpec(train_data_dir=str(folder)))
    with pytest.warns(UserWarning, match=r"hdr\.tiff.*values in \[300, 300\].*rescale it to \[0, 1\]"):
        decoded = decode_cache.decode_dataset(dataset, "image", 4, True, 1, pixels=data.PixelFormat("float32"))
    assert len(decoded) == 1


RGBA = np.array([[[200, 100, 0, 255], [200, 100, 0, 0], [200, 100, 0, 128], [0, 0, 0, 0]]] * 4, np.uint8)


@pytest.mark.parametrize("background, rgb", [("white", (255, 255, 255)), ("black", (0, 0, 0)),
                                             ("#336699", (0x33, 0x66, 0x99))])
def test_transparency_is_composited_on_the_background(tmp_path, background, rgb):
    folder = one_image_folder(tmp_path, Image.fromarray(RGBA, "RGBA"))
    tensor = training_tensor(folder, background=background)
    alpha = RGBA[..., 3:].astype(np.float64) / 255
    expected = RGBA[..., :3] * alpha + np.array(rgb) * (1 - alpha)  # 'over' onto an opaque background
    got = (tensor.permute(1, 2, 0).double() + 1) * 127.5
    assert np.abs(got.numpy() - expected).max() <= 1.0  # Pillow's 8-bit compositing rounds
    assert tuple(got[0, 1].round().int().tolist()) == rgb  # a fully transparent pixel is the background


KEY_COLOUR = (0, 100, 200)
KEYED_RGB = np.array([[KEY_COLOUR, (10, 20, 30), KEY_COLOUR, (250, 0, 0)]] * 4, np.uint8)
KEYED = {  # files whose transparency is a key (tRNS), as PNG optimisers write them: (image, save options)
    "rgb.png": (Image.fromarray(KEYED_RGB), {"transparency": KEY_COLOUR}),
    "l.png": (Image.fromarray(KEYED_RGB[..., 1]), {"transparency": 100}),
    "palette.png": (Image.fromarray(KEYED_RGB).quantize(4), {}),  # its key set below: the entry of KEY_COLOUR
    "gray16.png": (png_bytes(np.array([[[1000], [30000], [1000], [65535]]] * 4), colour_type=0,
                             chunks=png_chunk(b"tRNS", struct.pack(">H", 1000))), {}),  # Pillow 10.0 cannot write it
    # 2 bits a sample, as optimisers shrink a few grey levels: Pillow reads 1 as 85 and compares the key 1 with it
    "gray2.png": (png_bytes(np.array([[[1], [2], [1], [3]]] * 4), colour_type=0, depth=2,
                            chunks=png_chunk(b"tRNS", struct.pack(">H", 1))), {}),
}


@pytest.mark.parametrize("name", KEYED)
def test_a_transparency_key_is_composited_on_the_background_and_kept_as_alpha_alike(tmp_path, name):
    image, options = KEYED[name]
    if name == "palette.png":
        options = {"transparency": image.getpixel((0, 0))}
    folder = tmp_path / "images"
    folder.mkdir()
    image.save(folder / name, **options) if isinstance(image, Image.Image) else (folder / name).write_bytes(image)
    with Image.open(folder / name) as stored:
        assert "transparency" in stored.info and "A" not in stored.mode  # a key, no alpha channel
        deep = stored.mode.startswith("I")  # I;16, or I before Pillow 10.3
        colour = (np.asarray(stored) / 65535)[..., None] if deep else np.asarray(stored.convert("RGB")) / 255
    transparent = np.zeros((4, 4), bool)
    transparent[:, [0, 2]] = True  # the key's pixels, as each file is made

    background = (0x33, 0x66, 0x99)
    composited = unit_values(training_tensor(folder, background="#336699"))
    channels = composited.shape[-1]
    level = np.asarray(Image.new("RGB", (1, 1), background).convert("L" if channels == 1 else "RGB")) / 255
    expected = np.where(transparent[..., None], level.reshape(-1), colour[..., :channels])
    assert np.abs(composited - expected).max() < 1e-5  # the key's pixels are the background, the others the file

    kept = unit_values(training_tensor(tmp_path / "images", keep_alpha=True))
    assert np.array_equal(kept[..., 3] == 0, transparent) and (kept[..., 3][~transparent] == 1).all()
    assert np.abs(kept[..., :3] - colour).max() < 1e-5  # the colour as stored, its alpha beside it


def test_16_bit_gray_alpha_and_a_grey_palette_train_as_grayscale(tmp_path):
    gray_alpha = np.stack([SIXTEEN_BIT, np.array([[65535, 0, 65535, 32768]] * 4, np.uint16)], -1)
    grey_palette = Image.fromarray(KEYED_RGB[..., 1]).convert("P")  # palette entries r = g = b
    cases = {"gray_alpha16.png": png_bytes(gray_alpha.astype(">u2"), colour_type=4), "grey_palette.png": grey_palette,
             "colour_palette.png": Image.fromarray(KEYED_RGB).quantize(4)}
    for name, file in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        file.save(folder / name) if isinstance(file, Image.Image) else (folder / name).write_bytes(file)
        with Image.open(folder / name) as stored:
            assert stored.mode == {"gray_alpha16.png": "RGBA"}.get(name, "P")  # Pillow's modes, 3 channels
            stored.load()
            on_white = Image.alpha_composite(Image.new("RGBA", stored.size, (255, 255, 255, 255)),
                                             stored.convert("RGBA"))
        found = sources.open_training_data(DataSpec(train_data_dir=str(folder)), OneProcess())[1]
        assert found == (3 if name.startswith("colour") else 1), name
        if name.startswith("colour"):
            continue
        with pytest.warns(UserWarning, match="gray.alpha") if name.startswith("gray") else nullcontext():
            got = training_tensor(folder)
        assert np.array_equal(np.round(unit_values(got) * 255)[..., 0], np.asarray(on_white.convert("L"))), name


def test_keep_alpha_trains_four_channels(tmp_path):
    folder = one_image_folder(tmp_path, Image.fromarray(RGBA, "RGBA"))
    spec = DataSpec(train_data_dir=str(folder), keep_alpha=True)
    assert sources.open_training_data(spec, OneProcess())[1] == 4
    tensor = training_tensor(folder, keep_alpha=True)
    assert torch.equal(tensor, torch.from_numpy(RGBA).permute(2, 0, 1).float() / 127.5 - 1)


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((4, 8), np.uint8)
    pixels[:, :4] = 255  # left half white as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    folder = one_image_folder(tmp_path, Image.fromarray(pixels), "phone.jpg", exif=exif, quality=100)
    with Image.open(folder / "phone.jpg") as stored:
        shown = np.asarray(data.preprocess_image(stored, 4, False, 1))[:, :, 0]
    assert shown.shape == (8, 4)  # upright: taller than wide
    assert shown[:4].mean() > 200 and shown[4:].mean() < 50  # stored left is displayed top


def test_palette_cmyk_and_la_convert_as_pillow_defines_them(tmp_path):
    rgb = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255], [10, 20, 30]]] * 4, np.uint8)
    palette = Image.fromarray(rgb).quantize(4)
    palette.info["transparency"] = 0  # the palette entry of pixel (0, 0) is transparent
    cases = {"p.png": palette, "cmyk.jpg": Image.fromarray(rgb).convert("CMYK"),
             "la.png": Image.fromarray(np.stack([rgb[..., 0], RGBA[..., 3]], -1), "LA")}
    for name, image in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        image.save(folder / name, **({"quality": 100} if name.endswith("jpg") else {}))
        with Image.open(folder / name) as stored:
            stored.load()
            expected = np.asarray(Image.alpha_composite(Image.new("RGBA", stored.size, (255, 255, 255, 255)),
                                                        stored.convert("RGBA")).convert("RGB"))
            expected_gray = np.asarray(Image.fromarray(expected).convert("L"))
        channels = 1 if name.startswith("la") else 3
        got = np.round((training_tensor(folder).permute(1, 2, 0).numpy() + 1) * 127.5).astype(np.uint8)
        assert np.array_equal(got, expected if channels == 3 else expected_gray[..., None]), name
    p = np.round((training_tensor(tmp_path / "p_png").permute(1, 2, 0).numpy() + 1) * 127.5)
    transparent = np.asarray(palette) == 0  # the pixels of the transparent palette entry
    assert transparent.any() and (p[transparent] == 255).all() and (p[~transparent] < 255).any()


def test_the_cache_size_check_counts_the_bytes_per_sample(tmp_path):
    decode_cache.check_cache_space(str(tmp_path), 10, 8, 1, 4)
    with pytest.raises(data.DataError, match=r"samples of 2 byte\(s\)"):
        decode_cache.check_cache_space(str(tmp_path), 10 ** 12, 64, 3, 2)


def test_stored_format_is_the_deepest_mode(tmp_path):
    for name, image in {"a.png": Image.fromarray(np.zeros((2, 2), np.uint8)),
                        "b.png": Image.fromarray(SIXTEEN_BIT)}.items():
        image.save(tmp_path / name)
    items = [{"path": str(tmp_path / n), "bytes": None} for n in ("a.png", "b.png")]
    assert data.stored_format(items[:1]).dtype == "uint8"
    assert data.stored_format(items).dtype == "uint16"
    with pytest.raises(data.DataError, match="--background 'grey'"):
        data.parse_background("grey")


def test_the_command_line_trains_16_bit_and_transparent_images_as_stored(tiny_recipe, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for index in range(4):
        Image.fromarray(np.roll(SIXTEEN_BIT, index, axis=1)).resize((8, 8)).save(folder / f"depth{index}.png")
        Image.fromarray(np.roll(RGBA, index, axis=1)).resize((8, 8)).save(folder / f"sprite{index}.png")
    model = {"in_channels": 3, "out_channels": 3}
    recipe = tiny_recipe(max_train_samples=None, train_batch_size=4, model=_tiny_model(model))
    result = run_training(recipe, tmp_path / "run", "--train_data_dir", folder, "--max_train_steps", 2,
                          "--preserve_input_precision", "--background", "black")
    assert "decoded 8 images once (uint16 samples)" in result.stdout
    kept = run_training(tiny_recipe(max_train_samples=None, train_batch_size=4, model=_tiny_model({"in_channels": 4,
                                                                                         "out_channels": 4})),
                        tmp_path / "rgba", "--train_data_dir", folder, "--max_train_steps", 2, "--keep_alpha")
    assert "4 channel(s) (RGBA)" in kept.stdout
    with open(tmp_path / "rgba" / "unet" / "config.json") as fh:
        assert '"in_channels": 4' in fh.read()
    bad = run_training(recipe, tmp_path / "bad", "--train_data_dir", folder, "--background", "grey", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --background 'grey'")


def _tiny_model(overrides: dict) -> dict:
    from helpers import TINY_RECIPE
    return {**TINY_RECIPE["model"], **overrides}


def test_a_16_bit_colour_png_is_named_as_read_at_8_bits(tmp_path):
    samples = np.array([[[0, 1000, 65535], [30000, 256, 257]]], dtype=">u2")  # Pillow cannot write this
    path = tmp_path / "rgb16.png"
    path.write_bytes(png_bytes(samples, colour_type=2))
    with pytest.warns(UserWarning, match=r"rgb16\.png .*16-bit colour.*8-bit precision"):
        assert data.stored_format([{"path": str(path), "bytes": None}]).dtype == "uint8"
    with Image.open(path) as image:
        assert np.asarray(image)[0, 0, 1] == 1000 >> 8  # Pillow's top byte: the picture, at 8 bits
