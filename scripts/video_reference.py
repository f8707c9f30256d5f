#!/usr/bin/env python3
"""Makes the video test clips and writes their goldens under tests/fixtures/video/.

A careful numpy port, NOT transformers itself: torch, torchvision, torchcodec and transformers
are not installable here, so this script re-implements, from a reading of their source, what
transformers' Gemma 4 video path computes for a video file. The C++ tests never run Python; they
compare src/video against what this script wrote. Needs numpy and the ffmpeg/ffprobe programs
(Debian: python3-numpy ffmpeg; run it with /usr/bin/python3 where another python3 comes first).

What it ports (revisions as pinned in docs/video.md):
  * transformers src/transformers/video_utils.py read_video_torchcodec + torchcodec's
    VideoDecoder(seek_mode="exact") metadata (torchcodec src/torchcodec/_core/_metadata.py and
    SingleStreamDecoder.cpp scanFileAndUpdateMetadataAndIndex): the frame count is the number of
    packets of the video stream not flagged discard; begin = min(pts), end = max(pts + duration);
    average_fps = count / (end*tb - begin*tb), else the header's r_frame_rate. Here the packets
    come from `ffprobe -show_packets`, an independent reader of the same container.
  * transformers BaseVideoProcessor.sample_frames (video_processing_utils.py):
    torch.arange(0, total, total / num_frames).int() - a float32 arange (default dtype) whose
    elements are computed in double and stored as float32, then truncated.
  * Gemma4Processor.replace_video_token (processing_gemma4.py 03b33cc8): timestamps
    idx / fps, formatted f"{int(s // 60):02d}:{int(s % 60):02d}"; frames joined by " ".
  * the frames: `ffmpeg -sws_flags bilinear -pix_fmt rgb24`, the RGB24 conversion torchcodec's
    CPU path asks libswscale for (SWS_BILINEAR, the frame's colour matrix); frame i is the i-th
    frame in presentation order.
  * Gemma4VideoProcessor._preprocess (video_processing_gemma4.py 1bc9f9e6 / d3b12ab7):
    get_aspect_ratio_preserving_size (image_processing_gemma4.py 8af4d22a); torchvision
    F.resize(BICUBIC, antialias=True) on uint8, which on CPU is torch's uint8 antialiased
    separable resampler (aten/src/ATen/native/cpu/UpSampleKernel.cpp:
    _compute_indices_min_size_weights_aa, _compute_index_ranges_int16_weights, the uint8
    horizontal-then-vertical loops): double weights from the Keys cubic (a = -0.5) scaled by
    1/max(scale, 1), normalised, quantised to int16 with the largest precision p < 22 such that
    round(max_w * 2^(p+1)) < 2^15, accumulated from 2^(p-1), shifted right by p and clamped;
    an axis whose size does not change is skipped; rescale_and_normalize with do_rescale and
    do_normalize fused to (x - mean/r) / (std/r) in float32 (BaseImageProcessorFast /
    TorchvisionBackend._fuse_mean_std_and_rescale_factor, torchvision normalize = sub then div);
    convert_video_to_patches (C, Hp, p, Wp, p) -> (Hp, Wp, p, p, C); positions from
    meshgrid(arange(Wp), arange(Hp), indexing="xy") = (x, y); padding with 0 / -1 to max_patches.

Usage:
  video_reference.py clips     re-make the clips and the fuzz seeds (only when the clip set
                               changes: encoders' output differs between FFmpeg versions, and the
                               goldens follow the clips)
  video_reference.py goldens   write the goldens of the committed clips
"""

import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "video")

# name, ffmpeg arguments producing it from a synthetic source. Lengths, frame rates, aspect
# ratios, containers and codecs all vary; two clips have fewer or barely more frames than 32.
CLIPS = [
    ("h264_25fps_96x64.mp4",
     ["-f", "lavfi", "-i", "testsrc2=size=96x64:rate=25", "-frames:v", "50",
      "-c:v", "libx264", "-preset", "veryslow", "-crf", "32", "-g", "12", "-bf", "2",
      "-pix_fmt", "yuv420p"]),
    ("vp9_30fps_80x80.webm",
     ["-f", "lavfi", "-i", "testsrc2=size=80x80:rate=30", "-frames:v", "45",
      "-c:v", "libvpx-vp9", "-b:v", "0", "-crf", "50", "-g", "10", "-pix_fmt", "yuv420p"]),
    ("h264_24fps_120x40.mkv",
     ["-f", "lavfi", "-i", "testsrc2=size=120x40:rate=24", "-frames:v", "100",
      "-c:v", "libx264", "-preset", "veryslow", "-crf", "34", "-g", "30", "-pix_fmt", "yuv420p"]),
    ("mpeg4_2997fps_40x72.mov",
     ["-f", "lavfi", "-i", "testsrc2=size=40x72:rate=30000/1001", "-frames:v", "70",
      "-c:v", "mpeg4", "-qscale:v", "12", "-g", "15", "-pix_fmt", "yuv420p"]),
    ("gif_10fps_48x32.gif",
     ["-f", "lavfi", "-i", "testsrc2=size=48x32:rate=10", "-frames:v", "10", "-c:v", "gif"]),
    ("h264_1fps_32x24.mp4",
     ["-f", "lavfi", "-i", "testsrc2=size=32x24:rate=1", "-frames:v", "130",
      "-c:v", "libx264", "-preset", "veryslow", "-crf", "36", "-g", "20", "-pix_fmt", "yuv420p"]),
    ("h264_10fps_576x324.mp4",
     ["-f", "lavfi", "-i", "testsrc2=size=576x324:rate=10", "-frames:v", "34",
      "-c:v", "libx264", "-preset", "veryslow", "-crf", "42", "-g", "17", "-pix_fmt", "yuv420p"]),
]

# Seeds for fuzz/fuzz_video.cc: the same containers and codecs at 16x16, a few frames each.
FUZZ_SEEDS = [
    ("seed.mp4", ["-f", "lavfi", "-i", "testsrc2=size=16x16:rate=10", "-frames:v", "6",
                  "-c:v", "libx264", "-g", "3", "-bf", "1", "-pix_fmt", "yuv420p"]),
    ("seed.webm", ["-f", "lavfi", "-i", "testsrc2=size=16x16:rate=10", "-frames:v", "6",
                   "-c:v", "libvpx-vp9", "-g", "3", "-pix_fmt", "yuv420p"]),
    ("seed.mkv", ["-f", "lavfi", "-i", "testsrc2=size=16x16:rate=10", "-frames:v", "6",
                  "-c:v", "libx264", "-g", "3", "-pix_fmt", "yuv420p"]),
    ("seed.mov", ["-f", "lavfi", "-i", "testsrc2=size=16x16:rate=10", "-frames:v", "6",
                  "-c:v", "mpeg4", "-g", "3", "-pix_fmt", "yuv420p"]),
    ("seed.gif", ["-f", "lavfi", "-i", "testsrc2=size=16x16:rate=10", "-frames:v", "4",
                  "-c:v", "gif"]),
]
FUZZ_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "corpus",
                           "fuzz_video")

# The processor settings the goldens are written for: the Gemma 4 default (16-pixel patches,
# 3x3 pooling, 70 soft tokens per frame, 32 frames) and a reduced one (2-pixel patches, no
# pooling; the same code path), each summarised per frame (sums, RGB hashes), and "small8" (8
# frames, budget 140) whose full tensors are small enough to commit.
CONFIGS = {
    "default": dict(patch_size=16, pooling_kernel_size=3, max_soft_tokens=70, num_frames=32),
    "small": dict(patch_size=2, pooling_kernel_size=1, max_soft_tokens=70, num_frames=32),
    "small8": dict(patch_size=2, pooling_kernel_size=1, max_soft_tokens=140, num_frames=8),
}
RESCALE = 0.00392156862745098  # 1/255 as processor configs spell it


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, **kw).stdout


# ------------------------------------------------------------------------------ clips + metadata

def make_clips():
    for folder, clips in ((ROOT, CLIPS), (FUZZ_CORPUS, FUZZ_SEEDS)):
        os.makedirs(folder, exist_ok=True)
        for name, args in clips:
            out = os.path.join(folder, name)
            run(["ffmpeg", "-v", "error", "-y", *args, "-an", "-map_metadata", "-1",
                 "-fflags", "+bitexact", "-flags", "+bitexact", out])
            print(f"{name}: {os.path.getsize(out)} bytes")


def torchcodec_exact_metadata(path):
    """torchcodec's scan: frame count, begin/end and average fps of the best video stream."""
    streams = json.loads(run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                              "stream=time_base,r_frame_rate,width,height,codec_name",
                              "-of", "json", path]))["streams"][0]
    packets = json.loads(run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                              "packet=pts,dts,duration,flags", "-of", "json", path]))["packets"]
    num, den = (int(v) for v in streams["time_base"].split("/"))
    tb = num / den  # av_q2d
    pts = []
    keys = 0
    begin = end = None
    for p in packets:
        if "D" in p.get("flags", ""):
            continue
        t = int(p["pts"]) if "pts" in p and p["pts"] != "N/A" else int(p["dts"])
        d = int(p.get("duration", 0) or 0)
        pts.append(t)
        keys += "K" in p.get("flags", "")
        begin = t if begin is None else min(begin, t)
        end = t + d if end is None else max(end, t + d)
    total = len(pts)
    begin_s, end_s = begin * tb, end * tb
    if end_s != begin_s:
        fps = total / (end_s - begin_s)
        duration = end_s - begin_s
    else:
        fps = float(Fraction(streams["r_frame_rate"]))
        duration = 0.0
    return dict(total_frames=total, fps=fps, duration=duration, width=int(streams["width"]),
                height=int(streams["height"]), codec=streams["codec_name"], key_frames=keys)


def sample_frames(total, num_frames):
    """BaseVideoProcessor.sample_frames with num_frames (capped at total; transformers raises)."""
    num_frames = min(num_frames, total)
    step = total / num_frames
    length = math.ceil(total / step)
    values = (np.arange(length, dtype=np.float64) * step).astype(np.float32)
    return [int(v) for v in values.astype(np.int32)]


def timestamp(seconds):
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def decode_all_frames(path, width, height):
    raw = run(["ffmpeg", "-v", "error", "-i", path, "-map", "0:v:0", "-fps_mode", "passthrough",
               "-sws_flags", "bilinear", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
    frame_bytes = width * height * 3
    assert len(raw) % frame_bytes == 0, (path, len(raw), frame_bytes)
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, height, width, 3)


# ------------------------------------------------------------------------------ the processor

def aspect_ratio_preserving_size(height, width, patch_size, max_patches, pooling):
    total_px = height * width
    target_px = max_patches * patch_size * patch_size
    factor = math.sqrt(target_px / total_px)
    side = pooling * patch_size
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError("resize to 0x0")
    longest = (max_patches // (pooling * pooling)) * side
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        tw, th = side, min(int(math.floor(height / width)) * side, longest)
    if th * tw > target_px:
        raise ValueError("over budget")
    return th, tw


def keys_cubic(x):
    # torch HelperInterpCubic::aa_filter: a = -0.5, cubic_convolution1 / cubic_convolution2.
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def int16_axis(in_size, out_size):
    """Per output index: first input, int16 weights, and the shared precision."""
    scale = in_size / out_size
    support = (4 * 0.5) * scale if scale >= 1.0 else 4 * 0.5
    max_taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    rows = []
    wt_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(int(center + support + 0.5), in_size) - xmin
        xsize = min(max(xsize, 0), max_taps)
        w = [keys_cubic((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for v in w:
            total += v
        if total != 0.0:
            w = [v / total for v in w]
            for v in w:
                wt_max = max(wt_max, v)
        rows.append((xmin, w))
    precision = 0
    while precision < 22:
        if int(0.5 + wt_max * (1 << (precision + 1))) >= (1 << 15):
            break
        precision += 1
    quantised = []
    for xmin, w in rows:
        q = []
        for v in w:
            v = v * (1 << precision)
            q.append(int(-0.5 + v) if v < 0 else int(0.5 + v))  # C casts truncate toward 0
        quantised.append((xmin, np.array(q, dtype=np.int64)))
    return quantised, precision


def resample_axis(img, axis, out_size):
    """One separable pass over axis 1 (width) or 0 (height) of an [H, W, 3] uint8 image."""
    in_size = img.shape[axis]
    rows, precision = int16_axis(in_size, out_size)
    src = np.moveaxis(img.astype(np.int64), axis, 0)
    out = np.empty((out_size,) + src.shape[1:], dtype=np.int64)
    for i, (xmin, w) in enumerate(rows):
        acc = np.full(src.shape[1:], 1 << (precision - 1), dtype=np.int64)
        for j, wj in enumerate(w):
            acc += src[xmin + j] * int(wj)
        out[i] = np.clip(acc >> precision, 0, 255)
    return np.moveaxis(out, 0, axis).astype(np.uint8)


def resize_uint8_bicubic_aa(img, out_h, out_w):
    h, w = img.shape[:2]
    if out_w != w:
        img = resample_axis(img, 1, out_w)
    if out_h != h:
        img = resample_axis(img, 0, out_h)
    return img


def process_frames(frames, patch_size, pooling_kernel_size, max_soft_tokens):
    max_patches = max_soft_tokens * pooling_kernel_size ** 2
    h, w = frames.shape[1:3]
    th, tw = aspect_ratio_preserving_size(h, w, patch_size, max_patches, pooling_kernel_size)
    if (th, tw) != (h, w):
        frames = np.stack([resize_uint8_bicubic_aa(f, th, tw) for f in frames])
    # Fused rescale + normalize: mean' = float32(0) * float32(1/r), std' = float32(1) * float32(1/r)
    inv = np.float32(1.0 / RESCALE)
    mean = np.float32(0.0) * inv
    std = np.float32(1.0) * inv
    x = (frames.astype(np.float32) - mean) / std
    f = x.shape[0]
    hp, wp = th // patch_size, tw // patch_size
    # (F, H, W, C) -> (F, C, Hp, p, Wp, p) -> (F, Hp, Wp, p, p, C)
    chw = np.transpose(x, (0, 3, 1, 2)).reshape(f, 3, hp, patch_size, wp, patch_size)
    patches = np.transpose(chw, (0, 2, 4, 3, 5, 1)).reshape(f, hp * wp, -1)
    xs, ys = np.meshgrid(np.arange(wp), np.arange(hp), indexing="xy")
    pos = np.stack([xs, ys], axis=-1).reshape(hp * wp, 2)
    pv = np.zeros((f, max_patches, patches.shape[2]), dtype=np.float32)
    pv[:, :hp * wp] = patches
    pid = np.full((f, max_patches, 2), -1, dtype=np.int64)
    pid[:, :hp * wp] = pos
    return pv, pid, (hp * wp) // pooling_kernel_size ** 2, (th, tw)


# ------------------------------------------------------------------------------ goldens

def write_goldens():
    import hashlib
    index = {}
    for name, _ in CLIPS:
        path = os.path.join(ROOT, name)
        meta = torchcodec_exact_metadata(path)
        frames = decode_all_frames(path, meta["width"], meta["height"])
        entry = dict(meta)
        entry["decoded_frames"] = int(frames.shape[0])
        assert frames.shape[0] == meta["total_frames"], (name, frames.shape[0], meta)
        for cfg_name, cfg in CONFIGS.items():
            idx = sample_frames(meta["total_frames"], cfg["num_frames"])
            sampled = frames[idx]
            pv, pid, k, (th, tw) = process_frames(sampled, cfg["patch_size"],
                                                  cfg["pooling_kernel_size"],
                                                  cfg["max_soft_tokens"])
            fps = meta["fps"] if meta["fps"] else 24.0
            stamps = [timestamp(i / fps) for i in idx]
            c = dict(cfg)
            c.update(indices=idx, timestamps=stamps, soft_tokens_per_frame=k,
                     resized=[th, tw], max_patches=int(pv.shape[1]),
                     rgb_sha256=[hashlib.sha256(f.tobytes()).hexdigest() for f in sampled],
                     pixel_sums=[float(v) for v in pv.astype(np.float64).sum(axis=(1, 2))],
                     pixel_sq_sums=[float(v) for v in
                                    (pv.astype(np.float64) ** 2).sum(axis=(1, 2))])
            if cfg_name == "small8":
                stem = f"{name}.{cfg_name}"
                np.save(os.path.join(ROOT, stem + ".pixel_values_videos.npy"), pv)
                np.save(os.path.join(ROOT, stem + ".video_position_ids.npy"), pid)
            entry[cfg_name] = c
        index[name] = entry
        print(f"{name}: {meta['total_frames']} frames at {meta['fps']:.6g} fps, "
              f"default K={entry['default']['soft_tokens_per_frame']} "
              f"resized {entry['default']['resized']}")
    # The default-config tensors of the first row of patches of one frame in full (the first
    # frame of the first clip); the per-frame sums cover the rest.
    name = CLIPS[0][0]
    meta = index[name]
    frames = decode_all_frames(os.path.join(ROOT, name), meta["width"], meta["height"])
    pv, pid, _, (_, tw) = process_frames(frames[[0]], 16, 3, 70)
    np.save(os.path.join(ROOT, name + ".default_frame0_row0.pixel_values.npy"), pv[0, :tw // 16])
    with open(os.path.join(ROOT, "goldens.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.write("\n")


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("clips", "goldens"):
        print(__doc__.split("Usage:")[1], file=sys.stderr)
        sys.exit(2)
    if sys.argv[1] == "clips":
        make_clips()
    else:
        write_goldens()


if __name__ == "__main__":
    main()
