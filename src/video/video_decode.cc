#include "video/video_decode.h"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/avutil.h>
#include <libavutil/dict.h>
#include <libavutil/mem.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"

namespace gemstage {

namespace {

// What the demuxer may be (FFmpeg's demuxer names; one name of a multi-name demuxer is enough
// for av_match_list) and what the decoder may be. Everything else is refused before FFmpeg
// probes deeper or opens a decoder, which keeps the attack surface to the formats we document.
constexpr const char* kFormatWhitelist = "mov,matroska,gif";
constexpr AVCodecID kAllowedCodecs[] = {
    AV_CODEC_ID_H264,  AV_CODEC_ID_HEVC,  AV_CODEC_ID_VP8,        AV_CODEC_ID_VP9,
    AV_CODEC_ID_AV1,   AV_CODEC_ID_MPEG4, AV_CODEC_ID_MPEG1VIDEO, AV_CODEC_ID_MPEG2VIDEO,
    AV_CODEC_ID_MJPEG, AV_CODEC_ID_GIF,   AV_CODEC_ID_PNG,        AV_CODEC_ID_PRORES,
};
constexpr int kAvioBufferSize = 64 * 1024;
constexpr unsigned kMaxStreams = 256;

std::string av_error_text(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  if (av_strerror(code, buf, sizeof buf) < 0) return "FFmpeg error " + std::to_string(code);
  return buf;
}

// The bytes FFmpeg reads, through our own AVIOContext: FFmpeg's protocols (file, http, pipe,
// concat, ...) are never involved, so an input cannot make it open anything else.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual int read(uint8_t* buf, int size) = 0;
  virtual int64_t seek(int64_t offset, int whence) = 0;
};

class MemorySource final : public ByteSource {
 public:
  explicit MemorySource(std::span<const uint8_t> data) : data_(data) {}
  int read(uint8_t* buf, int size) override {
    if (pos_ >= data_.size()) return AVERROR_EOF;
    const size_t n = std::min(static_cast<size_t>(size), data_.size() - pos_);
    std::memcpy(buf, data_.data() + pos_, n);
    pos_ += n;
    return static_cast<int>(n);
  }
  int64_t seek(int64_t offset, int whence) override {
    const int64_t size = static_cast<int64_t>(data_.size());
    if (whence == AVSEEK_SIZE) return size;
    int64_t base = 0;
    switch (whence & ~AVSEEK_FORCE) {
      case SEEK_SET:
        base = 0;
        break;
      case SEEK_CUR:
        base = static_cast<int64_t>(pos_);
        break;
      case SEEK_END:
        base = size;
        break;
      default:
        return AVERROR(EINVAL);
    }
    int64_t target = 0;
    if (__builtin_add_overflow(base, offset, &target) || target < 0) return AVERROR(EINVAL);
    pos_ = static_cast<size_t>(std::min(target, size));
    return target;
  }

 private:
  std::span<const uint8_t> data_;
  size_t pos_ = 0;
};

class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(path, ": cannot open the video file (", std::strerror(errno), ")");
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      fail(path, ": not a regular file");
    }
  }
  ~FileSource() override { ::close(fd_); }
  int read(uint8_t* buf, int size) override {
    for (;;) {
      const ssize_t n = ::read(fd_, buf, static_cast<size_t>(size));
      if (n > 0) return static_cast<int>(n);
      if (n == 0) return AVERROR_EOF;
      if (errno != EINTR) return AVERROR(errno);
    }
  }
  int64_t seek(int64_t offset, int whence) override {
    if (whence == AVSEEK_SIZE) {
      struct stat st {};
      return ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : AVERROR(errno);
    }
    const off_t r = ::lseek(fd_, static_cast<off_t>(offset), whence & ~AVSEEK_FORCE);
    return r < 0 ? AVERROR(errno) : static_cast<int64_t>(r);
  }

 private:
  int fd_ = -1;
};

int read_callback(void* opaque, uint8_t* buf, int size) {
  return static_cast<ByteSource*>(opaque)->read(buf, size);
}

int64_t seek_callback(void* opaque, int64_t offset, int whence) {
  return static_cast<ByteSource*>(opaque)->seek(offset, whence);
}

// A container that names another resource (an HLS playlist, a MOV data reference, a concat
// list) asks io_open for it; the answer is always no.
int refuse_io_open(AVFormatContext*, AVIOContext**, const char*, int, AVDictionary**) {
  return AVERROR(EPERM);
}

double pts_seconds(int64_t pts, AVRational tb) {
  return static_cast<double>(pts) * av_q2d(tb);
}

}  // namespace

struct VideoDecoder::Impl {
  std::string what;
  VideoLimits limits;
  std::unique_ptr<ByteSource> source;
  AVIOContext* avio = nullptr;
  AVFormatContext* fmt = nullptr;
  AVCodecContext* codec = nullptr;
  SwsContext* sws = nullptr;
  int sws_width = 0, sws_height = 0, sws_format = -1, sws_colorspace = -1;
  uint8_t* rgb_buffer = nullptr;  // av_malloc'd, 64-byte aligned rows for swscale
  size_t rgb_buffer_size = 0;
  AVPacket* packet = nullptr;
  AVFrame* frame = nullptr;
  int stream = -1;
  AVRational time_base{0, 1};
  std::vector<int64_t> frame_pts;  // every frame's pts, ascending: frame i is frame_pts[i]
  std::vector<int64_t> key_pts;    // key frames' pts, ascending
  VideoInfo info;
  bool draining = false;  // the demuxer is exhausted and the decoder is being flushed
  int sampled_width = 0, sampled_height = 0;

  ~Impl() {
    av_frame_free(&frame);
    av_packet_free(&packet);
    sws_freeContext(sws);
    av_free(rgb_buffer);
    avcodec_free_context(&codec);
    avformat_close_input(&fmt);  // leaves our custom AVIOContext alone
    if (avio) {
      av_freep(&avio->buffer);
      avio_context_free(&avio);
    }
  }

  void open(std::unique_ptr<ByteSource> src);
  void scan();
  void open_decoder(const AVCodec* decoder);
  void seek_to(int64_t pts);
  bool next_frame(VideoDecodeStats& stats);
  int64_t frame_time(const AVFrame* f) const;
  void convert(const AVFrame* f, int64_t index, RgbImage& out);
};

void VideoDecoder::Impl::open(std::unique_ptr<ByteSource> src) {
  source = std::move(src);
  auto* buffer = static_cast<uint8_t*>(av_malloc(kAvioBufferSize));
  if (!buffer) fail(what, ": out of memory opening the video");
  avio = avio_alloc_context(buffer, kAvioBufferSize, 0, source.get(), read_callback, nullptr,
                            seek_callback);
  if (!avio) {
    av_free(buffer);
    fail(what, ": out of memory opening the video");
  }
  fmt = avformat_alloc_context();
  if (!fmt) fail(what, ": out of memory opening the video");
  fmt->pb = avio;
  fmt->flags |= AVFMT_FLAG_CUSTOM_IO;
  fmt->io_open = refuse_io_open;
  fmt->format_whitelist = av_strdup(kFormatWhitelist);
  if (!fmt->format_whitelist) fail(what, ": out of memory opening the video");
  int r = avformat_open_input(&fmt, nullptr, nullptr, nullptr);
  if (r < 0) {
    // avformat_open_input frees the context on failure.
    fmt = nullptr;
    fail(what, ": not a video FFmpeg can read as MP4/MOV, Matroska/WebM or GIF (", av_error_text(r),
         ")");
  }
  if (fmt->nb_streams == 0) fail(what, ": the container holds no streams");
  if (fmt->nb_streams > kMaxStreams)
    fail(what, ": the container declares ", fmt->nb_streams, " streams, over the limit of ",
         kMaxStreams);
  // avformat_find_stream_info may decode a few frames of each stream: those decoders get the
  // same pixel limit as ours.
  std::vector<AVDictionary*> options(fmt->nb_streams, nullptr);
  for (AVDictionary*& d : options) {
    av_dict_set_int(&d, "max_pixels", limits.max_frame_pixels, 0);
    av_dict_set(&d, "threads", "1", 0);
  }
  r = avformat_find_stream_info(fmt, options.data());
  for (AVDictionary*& d : options) av_dict_free(&d);
  if (r < 0) fail(what, ": cannot read the stream parameters (", av_error_text(r), ")");

  const AVCodec* decoder = nullptr;
  stream = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, &decoder, 0);
  if (stream == AVERROR_STREAM_NOT_FOUND) fail(what, ": the file has no video stream");
  if (stream < 0 || !decoder) {
    const AVStream* any = nullptr;
    for (unsigned i = 0; i < fmt->nb_streams; ++i)
      if (fmt->streams[i]->codecpar->codec_type == AVMEDIA_TYPE_VIDEO) any = fmt->streams[i];
    fail(what, ": no decoder for its video stream",
         any ? std::string(" (codec ") + avcodec_get_name(any->codecpar->codec_id) + ")" : "");
  }
  AVStream* st = fmt->streams[stream];
  const AVCodecParameters* par = st->codecpar;
  info.container = fmt->iformat->name;
  info.codec = avcodec_get_name(par->codec_id);
  if (std::find(std::begin(kAllowedCodecs), std::end(kAllowedCodecs), par->codec_id) ==
      std::end(kAllowedCodecs))
    fail(what, ": video codec ", info.codec,
         " is not supported (H.264, HEVC, VP8, VP9, AV1, MPEG-4, MPEG-1/2, Motion JPEG, GIF, "
         "PNG and ProRes are)");
  if (par->width <= 0 || par->height <= 0)
    fail(what, ": the video stream declares a ", par->width, "x", par->height,
         " frame size; the file is corrupt");
  if (int64_t{par->width} * par->height > limits.max_frame_pixels)
    fail(what, ": video frames are ", par->width, "x", par->height, " = ",
         int64_t{par->width} * par->height, " pixels, over the limit of ", limits.max_frame_pixels,
         " pixels");
  info.width = par->width;
  info.height = par->height;
  time_base = st->time_base;
  if (time_base.num <= 0 || time_base.den <= 0)
    fail(what, ": the video stream has an invalid time base ", time_base.num, "/", time_base.den);
  scan();
  open_decoder(decoder);
  packet = av_packet_alloc();
  frame = av_frame_alloc();
  if (!packet || !frame) fail(what, ": out of memory opening the video");
}

// torchcodec's "exact" scan (docs/video.md, "Decoding"): one pass over the packets, no decoding.
void VideoDecoder::Impl::scan() {
  for (unsigned i = 0; i < fmt->nb_streams; ++i)
    if (static_cast<int>(i) != stream) fmt->streams[i]->discard = AVDISCARD_ALL;
  AVPacket* pkt = av_packet_alloc();
  if (!pkt) fail(what, ": out of memory scanning the video");
  int64_t min_pts = std::numeric_limits<int64_t>::max();
  int64_t max_end = std::numeric_limits<int64_t>::min();
  std::string error;
  for (;;) {
    const int r = av_read_frame(fmt, pkt);
    // A read error ends the scan like the end of the file: a truncated download keeps the
    // frames before the damage (torchcodec would refuse the file).
    if (r < 0) break;
    if (pkt->stream_index == stream && !(pkt->flags & AV_PKT_FLAG_DISCARD)) {
      const int64_t pts = pkt->pts != AV_NOPTS_VALUE ? pkt->pts : pkt->dts;
      int64_t end = 0;
      if (pts == AV_NOPTS_VALUE) {
        error = "a video packet has no timestamp";
      } else if (__builtin_add_overflow(pts, std::max<int64_t>(pkt->duration, 0), &end)) {
        error = "a video packet's timestamp is out of range";
      } else if (static_cast<int64_t>(frame_pts.size()) >= limits.max_stream_frames) {
        error = "the video stream has more than " + std::to_string(limits.max_stream_frames) +
                " frames";
      }
      if (!error.empty()) {
        av_packet_free(&pkt);
        fail(what, ": ", error);
      }
      min_pts = std::min(min_pts, pts);
      max_end = std::max(max_end, end);
      frame_pts.push_back(pts);
      if (pkt->flags & AV_PKT_FLAG_KEY) key_pts.push_back(pts);
    }
    av_packet_unref(pkt);
  }
  av_packet_free(&pkt);
  if (frame_pts.empty()) fail(what, ": the video stream holds no frames");
  std::sort(frame_pts.begin(), frame_pts.end());
  std::sort(key_pts.begin(), key_pts.end());
  info.total_frames = static_cast<int64_t>(frame_pts.size());
  const double begin_s = pts_seconds(min_pts, time_base);
  const double end_s = pts_seconds(max_end, time_base);
  const AVStream* st = fmt->streams[stream];
  if (end_s != begin_s) {
    info.duration_seconds = end_s - begin_s;
    info.fps = static_cast<double>(info.total_frames) / info.duration_seconds;
  } else {
    if (st->duration > 0) info.duration_seconds = pts_seconds(st->duration, time_base);
    if (st->r_frame_rate.num > 0 && st->r_frame_rate.den > 0) info.fps = av_q2d(st->r_frame_rate);
  }
  if (!(info.fps > 0.0) || !std::isfinite(info.fps)) info.fps = 0.0;
  if (!(info.duration_seconds > 0.0) || !std::isfinite(info.duration_seconds))
    info.duration_seconds = 0.0;
}

void VideoDecoder::Impl::open_decoder(const AVCodec* decoder) {
  codec = avcodec_alloc_context3(decoder);
  if (!codec) fail(what, ": out of memory opening the ", info.codec, " decoder");
  int r = avcodec_parameters_to_context(codec, fmt->streams[stream]->codecpar);
  if (r < 0) fail(what, ": cannot set up the ", info.codec, " decoder (", av_error_text(r), ")");
  codec->thread_count = limits.decoder_threads;
  codec->pkt_timebase = time_base;
  codec->max_pixels = limits.max_frame_pixels;
  r = avcodec_open2(codec, decoder, nullptr);
  if (r < 0) fail(what, ": cannot open the ", info.codec, " decoder (", av_error_text(r), ")");
}

void VideoDecoder::Impl::seek_to(int64_t pts) {
  int r = avformat_seek_file(fmt, stream, std::numeric_limits<int64_t>::min(), pts, pts, 0);
  if (r < 0) {
    // No index to seek by (some GIFs): start from the beginning of the file.
    r = avformat_seek_file(fmt, -1, std::numeric_limits<int64_t>::min(), 0, 0, AVSEEK_FLAG_BYTE);
    if (r < 0) fail(what, ": cannot seek in the video (", av_error_text(r), ")");
  }
  avcodec_flush_buffers(codec);
  draining = false;
}

// The next frame the decoder returns, reading and sending packets as it needs them; false at
// the end of the stream. A packet the decoder rejects as corrupt is skipped, as ffmpeg does.
bool VideoDecoder::Impl::next_frame(VideoDecodeStats& stats) {
  for (;;) {
    int r = avcodec_receive_frame(codec, frame);
    if (r == 0) {
      ++stats.frames_decoded;
      return true;
    }
    if (r == AVERROR_EOF) return false;
    if (r != AVERROR(EAGAIN))
      fail(what, ": the ", info.codec, " decoder failed (", av_error_text(r), ")");
    if (draining) return false;
    r = av_read_frame(fmt, packet);
    if (r < 0) {
      draining = true;
      avcodec_send_packet(codec, nullptr);
      continue;
    }
    if (packet->stream_index != stream) {
      av_packet_unref(packet);
      continue;
    }
    r = avcodec_send_packet(codec, packet);
    av_packet_unref(packet);
    ++stats.packets_decoded;
    if (r == AVERROR(ENOMEM)) fail(what, ": out of memory decoding the video");
  }
}

int64_t VideoDecoder::Impl::frame_time(const AVFrame* f) const {
  if (f->pts != AV_NOPTS_VALUE) return f->pts;
  if (f->pkt_dts != AV_NOPTS_VALUE) return f->pkt_dts;
  return f->best_effort_timestamp;
}

void VideoDecoder::Impl::convert(const AVFrame* f, int64_t index, RgbImage& out) {
  const int w = f->width, h = f->height;
  if (w <= 0 || h <= 0 || int64_t{w} * h > limits.max_frame_pixels)
    fail(what, ": frame ", index, " is ", w, "x", h, ", outside 1..", limits.max_frame_pixels,
         " pixels");
  if (sampled_width == 0) {
    sampled_width = w;
    sampled_height = h;
  } else if (w != sampled_width || h != sampled_height) {
    // transformers stacks the sampled frames into one tensor and fails the same way.
    fail(what, ": frame ", index, " is ", w, "x", h, " but the first sampled frame is ",
         sampled_width, "x", sampled_height, "; videos that change resolution are not supported");
  }
  if (!sws || w != sws_width || h != sws_height || f->format != sws_format ||
      f->colorspace != sws_colorspace) {
    sws_freeContext(sws);
    sws = sws_getContext(w, h, static_cast<AVPixelFormat>(f->format), w, h, AV_PIX_FMT_RGB24,
                         SWS_BILINEAR, nullptr, nullptr, nullptr);
    if (!sws) {
      const char* name = av_get_pix_fmt_name(static_cast<AVPixelFormat>(f->format));
      fail(what, ": cannot convert frame ", index, " from pixel format ", name ? name : "unknown",
           " to RGB");
    }
    // The frame's colour matrix with the range swscale infers from the pixel format, as
    // torchcodec sets it.
    int *inv_table = nullptr, *table = nullptr;
    int src_range = 0, dst_range = 0, brightness = 0, contrast = 0, saturation = 0;
    if (sws_getColorspaceDetails(sws, &inv_table, &src_range, &table, &dst_range, &brightness,
                                 &contrast, &saturation) >= 0) {
      const int* coefficients = sws_getCoefficients(f->colorspace);
      sws_setColorspaceDetails(sws, coefficients, src_range, coefficients, dst_range, brightness,
                               contrast, saturation);
    }
    sws_width = w;
    sws_height = h;
    sws_format = f->format;
    sws_colorspace = f->colorspace;
  }
  // swscale writes whole SIMD blocks: rows padded to 64 bytes, then packed into `out`.
  const size_t stride = (static_cast<size_t>(w) * 3 + 63) & ~size_t{63};
  const size_t need = stride * static_cast<size_t>(h) + 64;
  if (rgb_buffer_size < need) {
    av_free(rgb_buffer);
    rgb_buffer = static_cast<uint8_t*>(av_malloc(need));
    rgb_buffer_size = rgb_buffer ? need : 0;
    if (!rgb_buffer) fail(what, ": out of memory converting frame ", index);
  }
  uint8_t* dst[4] = {rgb_buffer, nullptr, nullptr, nullptr};
  int dst_stride[4] = {static_cast<int>(stride), 0, 0, 0};
  const int rows = sws_scale(sws, f->data, f->linesize, 0, h, dst, dst_stride);
  if (rows != h)
    fail(what, ": converting frame ", index, " to RGB produced ", rows, " rows of ", h);
  out.width = w;
  out.height = h;
  out.rgb.resize(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    std::memcpy(out.rgb.data() + static_cast<size_t>(y) * w * 3, rgb_buffer + y * stride,
                static_cast<size_t>(w) * 3);
}

VideoDecoder::VideoDecoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VideoDecoder::~VideoDecoder() = default;

std::unique_ptr<VideoDecoder> VideoDecoder::open_file(const std::string& path,
                                                      const VideoLimits& limits) {
  auto impl = std::make_unique<Impl>();
  impl->what = path;
  impl->limits = limits;
  impl->open(std::make_unique<FileSource>(path));
  return std::unique_ptr<VideoDecoder>(new VideoDecoder(std::move(impl)));
}

std::unique_ptr<VideoDecoder> VideoDecoder::open_memory(std::span<const uint8_t> data,
                                                        const std::string& what,
                                                        const VideoLimits& limits) {
  if (data.empty()) fail(what, ": the video is empty");
  auto impl = std::make_unique<Impl>();
  impl->what = what;
  impl->limits = limits;
  impl->open(std::make_unique<MemorySource>(data));
  return std::unique_ptr<VideoDecoder>(new VideoDecoder(std::move(impl)));
}

const VideoInfo& VideoDecoder::info() const {
  return impl_->info;
}
const std::string& VideoDecoder::what() const {
  return impl_->what;
}

VideoDecodeStats VideoDecoder::decode_frames(
    std::span<const int64_t> indices,
    const std::function<void(size_t, const RgbImage&)>& on_frame) {
  Impl& d = *impl_;
  VideoDecodeStats stats;
  const auto& pts = d.frame_pts;
  const auto& keys = d.key_pts;
  bool have_last = false;  // a frame was decoded since the last seek
  int64_t last_pts = 0;
  RgbImage rgb;
  for (size_t k = 0; k < indices.size(); ++k) {
    const int64_t index = indices[k];
    if (index < 0 || index >= d.info.total_frames)
      fail(d.what, ": frame index ", index, " is outside the video's ", d.info.total_frames,
           " frames");
    if (k > 0 && index <= indices[k - 1])
      fail(d.what, ": frame indices must increase (", indices[k - 1], " then ", index, ")");
    const int64_t target = pts[static_cast<size_t>(index)];
    // The last key frame at or before the target; a stream without key flags starts at frame 0.
    auto key_it = std::upper_bound(keys.begin(), keys.end(), target);
    ptrdiff_t key = key_it == keys.begin() ? -1 : (key_it - keys.begin()) - 1;
    auto seek_pts = [&](ptrdiff_t key_index) {
      return key_index < 0 ? pts.front() : keys[key_index];
    };
    // Decoding on from where we are beats seeking unless a key frame lies between.
    bool seek = !have_last || last_pts >= target || seek_pts(key) > last_pts;
    for (;;) {
      if (seek) {
        d.seek_to(seek_pts(key));
        ++stats.seeks;
        have_last = false;
      }
      const bool just_seeked = seek;
      seek = false;
      bool found = false, overshot = false;
      while (d.next_frame(stats)) {
        const int64_t t = d.frame_time(d.frame);
        const bool first_after_seek = !have_last && just_seeked;
        have_last = true;
        last_pts = t;
        if (t < target) continue;
        if (t > target && first_after_seek && key >= 0) {
          // The seek landed past the target (an index keyed by decode time, open GOPs): start
          // one key frame earlier, down to the start of the stream.
          overshot = true;
          break;
        }
        found = true;
        break;
      }
      if (overshot) {
        --key;
        seek = true;
        continue;
      }
      if (!found)
        fail(d.what, ": frame ", index, " (pts ", target, ") could not be decoded",
             stats.frames_decoded == 0 ? "; the video data is corrupt" : "");
      break;
    }
    d.convert(d.frame, index, rgb);
    ++stats.frames_converted;
    on_frame(k, rgb);
  }
  return stats;
}

}  // namespace gemstage
