#!/usr/bin/env python3
"""Writes the PIL-made goldens under tests/fixtures/image/ (run once; the outputs are committed).

Needs numpy and Pillow (Debian: python3-numpy python3-pil). The C++ tests never run Python; they
only read what this script wrote. Re-running it with the same Pillow must reproduce the files.

Two sets:
  * decode/: small PNG and JPEG files in many modes, each with <name>.rgb.npy holding what
    transformers' load_image produces from it: PIL.Image.open -> ImageOps.exif_transpose ->
    convert("RGB"), as uint8 [H, W, 3].
  * resize/: one RGB source (src.png) and PIL's Image.resize(BICUBIC) of it to several odd sizes
    (up, down, one axis, mixed), as uint8 [H, W, 3] - what Gemma4ImageProcessorPil resizes with.
    When torch/torchvision are importable, also torchvision's resize(BICUBIC, antialias=True) of
    the same source as resize/tv_float_<W>x<H>.npy: on the torch 1.13 / torchvision 0.14 of
    Debian 12 this is the float32 path (what current torchvision still does on GPU), kept only to
    measure the residual of the CPU uint8 path against it.
"""

import io
import os
import sys

import numpy as np
from PIL import Image, ImageOps

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "image")
DECODE = os.path.join(ROOT, "decode")
RESIZE = os.path.join(ROOT, "resize")

RESIZE_TARGETS = [(101, 67), (17, 11), (45, 13), (77, 31), (29, 50), (7, 5), (130, 3)]


def pattern(w, h, seed):
    """Noise plus edges and gradients, so that rounding differences would show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.zeros((h, w, 3), dtype=np.int64)
    img[..., 0] = (x * 255) // max(w - 1, 1)
    img[..., 1] = (y * 255) // max(h - 1, 1)
    img[..., 2] = np.where((x // 4 + y // 3) % 2 == 0, 230, 20)
    img += rng.integers(-40, 41, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def save_case(name, data):
    path = os.path.join(DECODE, name)
    with open(path, "wb") as f:
        f.write(data)
    im = Image.open(io.BytesIO(data))
    im = ImageOps.exif_transpose(im)
    rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    np.save(path + ".rgb.npy", rgb)
    print(f"decode/{name}: mode {Image.open(io.BytesIO(data)).mode} -> {rgb.shape}")


def encode(im, fmt, **kw):
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def exif_with_orientation(o):
    ex = Image.Exif()
    ex[0x0112] = o
    return ex.tobytes()


def make_decode_cases():
    os.makedirs(DECODE, exist_ok=True)
    w, h = 23, 17
    rgb = Image.fromarray(pattern(w, h, 1), "RGB")
    gray = rgb.convert("L")

    save_case("gray8.png", encode(gray, "PNG"))
    g16 = (np.arange(w * h, dtype=np.uint32).reshape(h, w) * 97 % 1024).astype(np.uint16)
    save_case("gray16.png", encode(Image.fromarray(g16), "PNG"))  # values above 255 clip
    save_case("bilevel.png", encode(gray.point(lambda v: 255 if v > 128 else 0).convert("1"), "PNG"))
    la = Image.merge("LA", [gray, Image.fromarray(pattern(w, h, 2)[..., 0])])
    save_case("gray_alpha.png", encode(la, "PNG"))
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray(pattern(w, h, 3)[..., 1]))
    save_case("rgba.png", encode(rgba, "PNG"))
    pal = rgb.quantize(colors=13)
    save_case("palette.png", encode(pal, "PNG"))
    save_case("palette_trns.png", encode(pal, "PNG", transparency=3))
    save_case("rgb_interlaced.png", encode(rgb, "PNG", optimize=False) if False else
              _interlaced_png(rgb))
    save_case("rgb_exif6.png", encode(rgb, "PNG", exif=exif_with_orientation(6)))

    save_case("rgb420.jpg", encode(rgb, "JPEG", quality=90))
    save_case("rgb444_progressive.jpg",
              encode(rgb, "JPEG", quality=85, subsampling=0, progressive=True))
    save_case("gray.jpg", encode(gray, "JPEG", quality=90))
    save_case("cmyk.jpg", encode(rgb.convert("CMYK"), "JPEG", quality=95))
    for o in (2, 3, 4, 5, 6, 7, 8):
        save_case(f"rgb_exif{o}.jpg", encode(rgb, "JPEG", quality=90, exif=exif_with_orientation(o)))


def _interlaced_png(im):
    """Pillow cannot write Adam7; build the file from the raw scanlines with zlib instead."""
    import struct
    import zlib

    a = np.asarray(im, dtype=np.uint8)
    h, w, _ = a.shape
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
              (0, 1, 1, 2)]
    raw = bytearray()
    for x0, y0, dx, dy in passes:
        sub = a[y0::dy, x0::dx]
        if sub.size == 0:
            continue
        for row in sub:
            raw.append(0)  # filter type None
            raw.extend(row.tobytes())

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(
            ">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 1)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(raw)))
            + chunk(b"IEND", b""))


def make_resize_goldens():
    os.makedirs(RESIZE, exist_ok=True)
    src = Image.fromarray(pattern(45, 31, 7), "RGB")
    src.save(os.path.join(RESIZE, "src.png"))
    try:
        import torch
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as tvf
    except ImportError:
        torch = None
    for w, h in RESIZE_TARGETS:
        out = np.asarray(src.resize((w, h), resample=Image.BICUBIC), dtype=np.uint8)
        np.save(os.path.join(RESIZE, f"pil_{w}x{h}.npy"), out)
        if torch is not None:
            t = torch.from_numpy(np.asarray(src, dtype=np.uint8).copy()).permute(2, 0, 1)
            r = tvf.resize(t, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
            tv = r.permute(1, 2, 0).contiguous().numpy().astype(np.uint8)
            np.save(os.path.join(RESIZE, f"tv_float_{w}x{h}.npy"), tv)
            d = np.abs(tv.astype(int) - out.astype(int))
            print(f"resize {w}x{h}: torchvision {torch.__version__} float path vs PIL: "
                  f"max {d.max()}, {np.mean(d > 0) * 100:.2f}% differ")
        else:
            print(f"resize {w}x{h}: PIL only")


if __name__ == "__main__":
    print("Pillow", Image.__version__, file=sys.stderr)
    make_decode_cases()
    make_resize_goldens()
