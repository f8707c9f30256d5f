#include "audio/audio_features.h"

#include <fftw3.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <numbers>

#include "audio/audio_decode.h"
#include "core/error.h"

namespace gemstage {

namespace {

constexpr int kBins = kMelFftLength / 2 + 1;  // 257

double hz_to_mel_htk(double f) {
  return 2595.0 * std::log10(1.0 + f / 700.0);
}
double mel_to_hz_htk(double m) {
  return 700.0 * (std::pow(10.0, m / 2595.0) - 1.0);
}

// numpy.linspace(start, stop, n): start + i·step, the last point exactly stop.
std::vector<double> linspace(double start, double stop, int n) {
  std::vector<double> v(static_cast<size_t>(n));
  const double step = (stop - start) / (n - 1);
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + i * step;
  v.back() = stop;
  return v;
}

// The bank as per-filter bin ranges (most of the 257 × 128 entries are zero).
struct SparseMelBank {
  std::vector<int> first, count;  // per filter: first non-zero bin, number of bins
  std::vector<double> weights;    // concatenated non-zero runs
  std::vector<size_t> offset;
};

const SparseMelBank& mel_bank() {
  static const SparseMelBank bank = [] {
    const std::vector<double> dense = htk_mel_filter_bank();
    SparseMelBank b;
    for (int m = 0; m < kMelBins; ++m) {
      int lo = kBins, hi = -1;
      for (int k = 0; k < kBins; ++k)
        if (dense[static_cast<size_t>(k * kMelBins + m)] != 0.0) {
          lo = std::min(lo, k);
          hi = std::max(hi, k);
        }
      b.offset.push_back(b.weights.size());
      if (hi < lo) {
        b.first.push_back(0);
        b.count.push_back(0);
        continue;
      }
      b.first.push_back(lo);
      b.count.push_back(hi - lo + 1);
      for (int k = lo; k <= hi; ++k)
        b.weights.push_back(dense[static_cast<size_t>(k * kMelBins + m)]);
    }
    return b;
  }();
  return bank;
}

// np.hanning(321)[:-1] cast to float32: the periodic Hann window of 320.
const std::vector<float>& hann_window() {
  static const std::vector<float> w = [] {
    std::vector<float> v(kMelFrameLength);
    for (int n = 0; n < kMelFrameLength; ++n)
      v[static_cast<size_t>(n)] =
          static_cast<float>(0.5 - 0.5 * std::cos(2.0 * std::numbers::pi * n / kMelFrameLength));
    return v;
  }();
  return w;
}

// FFTW plans are created under a lock (the planner is not thread-safe); execution on other
// buffers of the same size and alignment is.
std::mutex& fftw_planner_mutex() {
  static std::mutex m;
  return m;
}

struct RealFft {
  int n;
  double* in;
  fftw_complex* out;
  fftw_plan plan;
  explicit RealFft(int size) : n(size) {
    std::lock_guard<std::mutex> lock(fftw_planner_mutex());
    in = fftw_alloc_real(static_cast<size_t>(n));
    out = fftw_alloc_complex(static_cast<size_t>(n / 2 + 1));
    plan = fftw_plan_dft_r2c_1d(n, in, out, FFTW_ESTIMATE);
  }
  ~RealFft() {
    std::lock_guard<std::mutex> lock(fftw_planner_mutex());
    fftw_destroy_plan(plan);
    fftw_free(in);
    fftw_free(out);
  }
  RealFft(const RealFft&) = delete;
  RealFft& operator=(const RealFft&) = delete;
  // |X_k| of in[0..n), numpy's abs (hypot).
  void magnitude(double* mag) {
    fftw_execute(plan);
    for (int k = 0; k <= n / 2; ++k) mag[k] = std::hypot(out[k][0], out[k][1]);
  }
};

}  // namespace

int64_t mel_frame_count(int64_t n_samples) {
  const int64_t padded = (n_samples + kMelPadMultiple - 1) / kMelPadMultiple * kMelPadMultiple;
  const int64_t span = padded + kMelHop - (kMelFrameLength + 1);
  return span < 0 ? 0 : span / kMelHop + 1;
}

int64_t mel_valid_frame_count(int64_t n_samples) {
  const int64_t span = n_samples + kMelHop - (kMelFrameLength + 1);
  return span < 0 ? 0 : span / kMelHop + 1;
}

int64_t audio_soft_tokens_for_frames(int64_t valid_frames) {
  if (valid_frames <= 0) return 0;
  const int64_t once = (valid_frames + 1) / 2;
  return std::min((once + 1) / 2, kAudioMaxSoftTokens);
}

int64_t audio_soft_tokens_for_samples(int64_t n_samples) {
  return audio_soft_tokens_for_frames(mel_valid_frame_count(n_samples));
}

std::vector<double> htk_mel_filter_bank() {
  const std::vector<double> fft_freqs = linspace(0.0, kAudioSampleRate / 2, kBins);
  const std::vector<double> mel = linspace(hz_to_mel_htk(0.0), hz_to_mel_htk(8000.0), kMelBins + 2);
  std::vector<double> f(mel.size());
  for (size_t i = 0; i < mel.size(); ++i) f[i] = mel_to_hz_htk(mel[i]);
  std::vector<double> bank(static_cast<size_t>(kBins * kMelBins));
  for (int k = 0; k < kBins; ++k)
    for (int m = 0; m < kMelBins; ++m) {
      const auto mm = static_cast<size_t>(m);
      const double down = -(f[mm] - fft_freqs[static_cast<size_t>(k)]) / (f[mm + 1] - f[mm]);
      const double up = (f[mm + 2] - fft_freqs[static_cast<size_t>(k)]) / (f[mm + 2] - f[mm + 1]);
      bank[static_cast<size_t>(k * kMelBins + m)] = std::max(0.0, std::min(down, up));
    }
  return bank;
}

LogMelFeatures log_mel_features(std::span<const float> waveform, const char* what) {
  const int64_t L = static_cast<int64_t>(waveform.size());
  if (L > kAudioMaxSamples)
    fail(what, ": ", L, " samples is over the 30 s (480000 samples at 16 kHz) a clip may have");
  LogMelFeatures out;
  out.frames = mel_frame_count(L);
  out.valid_frames = mel_valid_frame_count(L);
  if (out.valid_frames <= 0)
    fail(what, ": the clip has ", L, " samples; at least ", kMelFrameLength + 1 - kMelHop,
         " (about 10 ms at 16 kHz) are needed for one feature frame");
  const int64_t padded_len =
      kMelHop + (L + kMelPadMultiple - 1) / kMelPadMultiple * kMelPadMultiple;
  std::vector<float> padded(static_cast<size_t>(padded_len), 0.0f);
  std::copy(waveform.begin(), waveform.end(), padded.begin() + kMelHop);
  out.values.assign(static_cast<size_t>(out.frames * kMelBins), 0.0f);
  out.mask.assign(static_cast<size_t>(out.frames), 0);
  const std::vector<float>& win = hann_window();
  const SparseMelBank& bank = mel_bank();
  RealFft fft(kMelFftLength);
  std::fill(fft.in, fft.in + kMelFftLength, 0.0);
  double mag[kBins];
  for (int64_t i = 0; i < out.frames; ++i) {
    // Validity: original sample 160·i + 160 (padded index 160·i + 320) is real audio.
    if (i >= out.valid_frames) continue;  // zeroed, as the reference multiplies by the mask
    out.mask[static_cast<size_t>(i)] = 1;
    const float* frame = padded.data() + i * kMelHop;
    for (int n = 0; n < kMelFrameLength; ++n)
      fft.in[n] = static_cast<double>(frame[n] * win[static_cast<size_t>(n)]);  // f32 product
    fft.magnitude(mag);
    float* row = out.values.data() + i * kMelBins;
    for (int m = 0; m < kMelBins; ++m) {
      double s = 0.0;
      const double* w = bank.weights.data() + bank.offset[static_cast<size_t>(m)];
      const int k0 = bank.first[static_cast<size_t>(m)];
      for (int j = 0; j < bank.count[static_cast<size_t>(m)]; ++j) s += mag[k0 + j] * w[j];
      row[m] = static_cast<float>(std::log(s + 1e-3));
    }
  }
  return out;
}

std::vector<double> dft_magnitude_reference(std::span<const double> frame) {
  const int64_t n = static_cast<int64_t>(frame.size());
  std::vector<double> mag(static_cast<size_t>(n / 2 + 1));
  for (int64_t k = 0; k <= n / 2; ++k) {
    long double re = 0, im = 0;
    for (int64_t t = 0; t < n; ++t) {
      const long double a =
          -2.0L * std::numbers::pi_v<long double> * static_cast<long double>(k * t % n) / n;
      re += frame[static_cast<size_t>(t)] * std::cos(a);
      im += frame[static_cast<size_t>(t)] * std::sin(a);
    }
    mag[static_cast<size_t>(k)] = static_cast<double>(std::sqrt(re * re + im * im));
  }
  return mag;
}

std::vector<double> fft_magnitude(std::span<const double> frame, int n) {
  if (static_cast<int64_t>(frame.size()) > n) fail("fft_magnitude: frame longer than the FFT");
  RealFft fft(n);
  std::fill(fft.in, fft.in + n, 0.0);
  std::copy(frame.begin(), frame.end(), fft.in);
  std::vector<double> mag(static_cast<size_t>(n / 2 + 1));
  fft.magnitude(mag.data());
  return mag;
}

}  // namespace gemstage
