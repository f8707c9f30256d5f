// Video file decoding with FFmpeg's libraries (libavformat, libavcodec, libswscale) into the 8-bit
// RGB frames a Hugging Face Gemma 4 video processor sees, the way transformers loads a video
// (docs/video.md, "Decoding"):
//  - transformers' video processors decode with torchcodec in its "exact" seek mode. That mode
//    reads every packet of the best video stream once, without decoding, and takes from that scan
//    the frame count (one frame per packet not flagged discard), the stream's start (the
//    smallest pts) and end (the largest pts + duration), and the average fps
//    (count / (end - start); the header's r_frame_rate when the scan gives no span). Frame i is
//    the i-th frame in pts order. VideoDecoder does the same scan and numbers frames the same way.
//  - A frame is fetched by seeking to the last key frame at or before its pts and decoding
//    forward to it; a later sample in the same group of pictures continues decoding instead of
//    seeking again. A long clip is therefore never decoded whole, and frames that are not
//    sampled are decoded (the codec needs them) but never converted.
//  - Each sampled frame is converted to RGB24 once, by libswscale with SWS_BILINEAR and the
//    frame's colour matrix at the format's default range (torchcodec's CPU conversion); the
//    frame's sample aspect ratio and any rotation metadata are ignored, as there.
// Containers: MP4/MOV (and 3GP), Matroska/WebM, GIF. Codecs: H.264, HEVC, VP8, VP9, AV1, MPEG-4
// Part 2, MPEG-1/2, Motion JPEG, GIF, PNG, ProRes. Anything else is refused by name before a
// decoder is opened; FFmpeg never opens another file or URL on the input's behalf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "image/image_decode.h"

namespace gemstage {

struct VideoLimits {
  // Checked against the stream header before the decoder opens, passed to the decoder as its own
  // max_pixels, and checked again on every decoded frame. 40 MP covers 8K UHD (33.2 MP).
  int64_t max_frame_pixels = int64_t{40} * 1000 * 1000;
  // The scan's per-frame index (9 bytes a frame). 4M frames is over 18 hours at 60 fps.
  int64_t max_stream_frames = int64_t{4} * 1000 * 1000;
  // FFmpeg decoder threads; 0 lets FFmpeg choose (one per core), as torchcodec does.
  int decoder_threads = 0;
};

struct VideoInfo {
  std::string container;  // FFmpeg's demuxer name, e.g. "mov,mp4,m4a,3gp,3g2,mj2"
  std::string codec;      // e.g. "h264"
  int width = 0;          // the stream header's coded size
  int height = 0;
  int64_t total_frames = 0;       // frames in the stream, from the packet scan
  double fps = 0.0;               // total_frames / duration_seconds, else r_frame_rate; 0: unknown
  double duration_seconds = 0.0;  // end - start of the stream from the scan; 0: unknown
};

// Counters of one decode_frames call, for tests and benchmarks.
struct VideoDecodeStats {
  int64_t seeks = 0;            // seeks to a key frame
  int64_t packets_decoded = 0;  // packets handed to the decoder
  int64_t frames_decoded = 0;   // frames the decoder returned (converted or not)
  int64_t frames_converted = 0;
};

class VideoDecoder {
 public:
  // Opens, probes and scans a file. Errors name the path.
  static std::unique_ptr<VideoDecoder> open_file(const std::string& path,
                                                 const VideoLimits& limits = {});
  // Opens a video held in memory; `data` must outlive the decoder. `what` names it in errors
  // ("request video 1").
  static std::unique_ptr<VideoDecoder> open_memory(std::span<const uint8_t> data,
                                                   const std::string& what,
                                                   const VideoLimits& limits = {});
  ~VideoDecoder();
  VideoDecoder(const VideoDecoder&) = delete;
  VideoDecoder& operator=(const VideoDecoder&) = delete;

  const VideoInfo& info() const;
  const std::string& what() const;

  // Decodes the frames at `indices` (strictly increasing, each in [0, total_frames)) and calls
  // on_frame(k, rgb) for the k-th of them, in order. Only one RGB frame is alive at a time. A
  // frame that cannot be decoded (corrupt data, a frame size that differs from the first sampled
  // frame's) is an Error naming the source and the frame index.
  VideoDecodeStats decode_frames(std::span<const int64_t> indices,
                                 const std::function<void(size_t, const RgbImage&)>& on_frame);

  struct Impl;

 private:
  explicit VideoDecoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gemstage
