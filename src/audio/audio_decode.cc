#include "audio/audio_decode.h"

#include <samplerate.h>
#include <sndfile.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace gemstage {

namespace {

// libsndfile's virtual I/O over a byte buffer.
struct MemoryReader {
  const uint8_t* data;
  sf_count_t size;
  sf_count_t pos = 0;
};

sf_count_t mem_length(void* user) {
  return static_cast<MemoryReader*>(user)->size;
}
sf_count_t mem_seek(sf_count_t offset, int whence, void* user) {
  auto* m = static_cast<MemoryReader*>(user);
  sf_count_t to = offset;
  if (whence == SEEK_CUR) to = m->pos + offset;
  if (whence == SEEK_END) to = m->size + offset;
  m->pos = std::clamp<sf_count_t>(to, 0, m->size);
  return m->pos;
}
sf_count_t mem_read(void* ptr, sf_count_t count, void* user) {
  auto* m = static_cast<MemoryReader*>(user);
  const sf_count_t n = std::clamp<sf_count_t>(count, 0, m->size - m->pos);
  if (n > 0) std::memcpy(ptr, m->data + m->pos, static_cast<size_t>(n));
  m->pos += n;
  return n;
}
sf_count_t mem_write(const void*, sf_count_t, void*) {
  return 0;
}
sf_count_t mem_tell(void* user) {
  return static_cast<MemoryReader*>(user)->pos;
}

std::string format_name(int format) {
  SF_FORMAT_INFO major{}, sub{};
  major.format = format & SF_FORMAT_TYPEMASK;
  sub.format = format & SF_FORMAT_SUBMASK;
  std::string s;
  if (sf_command(nullptr, SFC_GET_FORMAT_INFO, &major, sizeof(major)) == 0 && major.name)
    s = major.name;
  if (sf_command(nullptr, SFC_GET_FORMAT_INFO, &sub, sizeof(sub)) == 0 && sub.name)
    s += (s.empty() ? "" : ", ") + std::string(sub.name);
  return s.empty() ? "unknown" : s;
}

}  // namespace

std::vector<float> mix_to_mono(const float* interleaved, int64_t frames, int channels) {
  std::vector<float> mono(static_cast<size_t>(frames));
  if (channels == 1) {
    std::copy_n(interleaved, frames, mono.begin());
    return mono;
  }
  const float n = static_cast<float>(channels);
  for (int64_t i = 0; i < frames; ++i) {
    const float* f = interleaved + i * channels;
    float s = f[0];
    for (int c = 1; c < channels; ++c) s += f[c];
    mono[static_cast<size_t>(i)] = s / n;
  }
  return mono;
}

std::vector<float> resample_to_16k(const std::vector<float>& mono, int rate,
                                   const std::string& what) {
  if (rate == kAudioSampleRate || mono.empty()) return mono;
  if (rate <= 0) fail(what, ": sample rate ", rate, " is not positive");
  const double ratio = static_cast<double>(kAudioSampleRate) / rate;
  const int64_t out_n = static_cast<int64_t>(std::ceil(static_cast<double>(mono.size()) * ratio));
  std::vector<float> out(static_cast<size_t>(out_n) + 1);
  SRC_DATA d{};
  d.data_in = mono.data();
  d.input_frames = static_cast<long>(mono.size());
  d.data_out = out.data();
  d.output_frames = static_cast<long>(out.size());
  d.src_ratio = ratio;
  d.end_of_input = 1;
  const int err = src_simple(&d, SRC_SINC_BEST_QUALITY, 1);
  if (err) fail(what, ": resampling from ", rate, " Hz to 16 kHz failed: ", src_strerror(err));
  out.resize(static_cast<size_t>(d.output_frames_gen));
  return out;
}

AudioClip decode_audio(const uint8_t* data, size_t size, const std::string& what,
                       const AudioLimits& limits) {
  if (size == 0) fail(what, ": the audio is empty (0 bytes)");
  MemoryReader mem{data, static_cast<sf_count_t>(size)};
  SF_VIRTUAL_IO io{mem_length, mem_seek, mem_read, mem_write, mem_tell};
  SF_INFO info{};
  SNDFILE* f = sf_open_virtual(&io, SFM_READ, &info, &mem);
  if (!f)
    fail(what, ": not an audio format gemstage can decode (libsndfile: ", sf_strerror(nullptr),
         "); give WAV (PCM or float), FLAC, OGG/Vorbis, Opus or MP3");
  struct Closer {
    SNDFILE* f;
    ~Closer() { sf_close(f); }
  } closer{f};
  AudioClip clip;
  clip.source_rate = info.samplerate;
  clip.source_channels = info.channels;
  clip.format = format_name(info.format);
  if (info.channels <= 0 || info.channels > limits.max_channels)
    fail(what, ": ", info.channels, " channels (", clip.format, "); at most ", limits.max_channels,
         " are accepted");
  if (info.samplerate <= 0 || info.samplerate > limits.max_rate)
    fail(what, ": sample rate ", info.samplerate, " Hz is outside (0, ", limits.max_rate, "]");
  // Frames allowed before the clip is too long; some formats do not know their length up front,
  // so reading stops one block past the limit either way.
  const int64_t max_frames =
      static_cast<int64_t>(std::floor(limits.max_seconds * info.samplerate)) + 1;
  auto too_long = [&](double seconds) {
    fail(what, ": the clip is ", seconds, " s long; Gemma 4 takes at most ", limits.max_seconds,
         " s of audio per clip (the processor's 480000 samples at 16 kHz). Split the recording "
         "into clips of at most 30 s and attach each one");
  };
  if (info.frames > 0 && info.frames < SF_COUNT_MAX && info.frames >= max_frames)
    too_long(static_cast<double>(info.frames) / info.samplerate);
  std::vector<float> interleaved;
  const int64_t block = 16384;
  std::vector<float> buf(static_cast<size_t>(block * info.channels));
  int64_t frames = 0;
  while (true) {
    const sf_count_t got = sf_readf_float(f, buf.data(), block);
    if (got <= 0) break;
    interleaved.insert(interleaved.end(), buf.begin(), buf.begin() + got * info.channels);
    frames += got;
    if (frames >= max_frames) too_long(static_cast<double>(frames) / info.samplerate);
  }
  if (sf_error(f) != SF_ERR_NO_ERROR)
    fail(what, ": decoding failed (", clip.format, "): ", sf_strerror(f));
  if (frames == 0) fail(what, ": the audio holds no samples (", clip.format, ")");
  for (float v : interleaved)
    if (!std::isfinite(v)) fail(what, ": the audio holds a NaN or infinite sample");
  const std::vector<float> mono = mix_to_mono(interleaved.data(), frames, info.channels);
  clip.samples = resample_to_16k(mono, info.samplerate, what);
  if (static_cast<int64_t>(clip.samples.size()) > kAudioMaxSamples) too_long(clip.seconds());
  return clip;
}

AudioClip decode_audio_file(const std::string& path, const AudioLimits& limits) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail(path, ": no such audio file");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail(path, ": cannot read its size: ", ec.message());
  // 30 s of 8-channel 384 kHz float audio is 369 MB; anything past 512 MiB is not one clip.
  if (size > (uintmax_t{512} << 20))
    fail(path, ": ", size, " bytes is too large for one audio clip of at most 30 s");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  std::ifstream in(path, std::ios::binary);
  if (!in || !in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size)))
    fail(path, ": cannot read the file");
  return decode_audio(bytes.data(), bytes.size(), path, limits);
}

}  // namespace gemstage
